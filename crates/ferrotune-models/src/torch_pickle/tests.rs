//! Unit tests of the `torch.save` reader and writer.

mod unit {
    use super::super::*;

    #[test]
    fn meta_names_map_to_hf() {
        assert_eq!(
            meta_to_hf_name("layers.3.feed_forward.w2.weight").as_deref(),
            Some("model.layers.3.mlp.down_proj.weight")
        );
        assert_eq!(
            meta_to_hf_name("layers.0.attention_norm.weight").as_deref(),
            Some("model.layers.0.input_layernorm.weight")
        );
        assert_eq!(meta_to_hf_name("layers.x.attention.wq.weight"), None);
        assert_eq!(meta_to_hf_name("layers.0.attention.inner_attention"), None);
    }

    #[test]
    fn rotary_rows_go_from_pairs_to_halves() {
        // One head of dim 4 (two pairs) over 1 input: Meta rows [a0, b0, a1, b1] (pairs (a, b)),
        // HF rows [a0, a1, b0, b1].
        let t = Tensor::new(&[[0f32], [1.], [2.], [3.]], &Device::Cpu).unwrap();
        let hf = unpermute_rotary(&t, 1, 4, 1).unwrap();
        assert_eq!(
            hf.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [0., 2., 1., 3.]
        );
        let back = permute_rotary_to_pairs(&hf, 1, 4).unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [0., 1., 2., 3.]
        );
    }
}

mod io_tests {
    use super::super::*;

    #[test]
    fn write_then_read_every_dtype() {
        let dir = std::env::temp_dir().join(format!("ferrotune-torchio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f32s = Tensor::new(&[[1.5f32, -2.0, 3.25], [0.0, 7.0, -0.5]], &Device::Cpu).unwrap();
        let tensors = vec![
            (
                "a.f32".to_string(),
                TorchTensor::from_tensor(&f32s).unwrap(),
            ),
            (
                "b.bf16".to_string(),
                TorchTensor::from_tensor(&f32s.to_dtype(DType::BF16).unwrap()).unwrap(),
            ),
            (
                "c.i8".to_string(),
                TorchTensor::from_i8(vec![2, 2], &[-8, 7, 0, -1]),
            ),
            (
                "d.i32".to_string(),
                TorchTensor::from_i32(vec![3], &[-5, 0, 1 << 20]),
            ),
            (
                "e.scalar".to_string(),
                TorchTensor::from_tensor(&Tensor::new(3.0f32, &Device::Cpu).unwrap()).unwrap(),
            ),
        ];
        let path = dir.join("state.pt");
        write_torch_file(&path, &tensors).unwrap();
        let back = read_torch_file(&path).unwrap();
        assert_eq!(back, tensors); // already in name order
        let codes = back[2].1.to_tensor(DType::F32, &Device::Cpu).unwrap();
        assert_eq!(codes.to_vec2::<f32>().unwrap(), [[-8., 7.], [0., -1.]]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn one_tensor_under_two_names_is_one_storage() {
        // A tied head: torch.save writes the embedding's storage once, referenced twice.
        let dir = std::env::temp_dir().join(format!("ferrotune-torchtied-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let embed = Tensor::new(&[[1.5f32, -2.0], [0.25, 4.0]], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let norm = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let tensors = vec![
            ("tok_embeddings.weight".to_string(), embed.clone()),
            ("norm.weight".to_string(), norm.clone()),
            ("output.weight".to_string(), embed.clone()),
        ];
        let path = dir.join("model-00001-of-00001.bin");
        write_torch_tensors(&path, &tensors).unwrap();
        let mut zip = zip::ZipArchive::new(std::fs::File::open(&path).unwrap()).unwrap();
        let names: Vec<String> = (0..zip.len())
            .map(|i| zip.by_index(i).unwrap().name().unwrap().to_string())
            .collect();
        let storages: Vec<&String> = names.iter().filter(|n| n.contains("/data/")).collect();
        assert_eq!(
            storages,
            ["model-00001-of-00001/data/0", "model-00001-of-00001/data/1"]
        );
        let back = read_torch_file(&path).unwrap();
        let get = |name: &str| back.iter().find(|(n, _)| n == name).unwrap().1.clone();
        assert_eq!(get("output.weight"), get("tok_embeddings.weight"));
        assert_eq!(
            get("output.weight"),
            TorchTensor::from_tensor(&embed).unwrap()
        );
        assert_eq!(get("norm.weight"), TorchTensor::from_tensor(&norm).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
