//! torch.save files: what PyTorch wrote (shared storages, views, parameters, int8/int32/bf16)
//! reads back as PyTorch holds it.

use candle_core::{DType, Device};
use ferrotune_models::torch_pickle::{read_torch_file, TorchDType};
use serde_json::Value;

#[test]
fn reads_what_torch_save_wrote() {
    let dir = ferrotune_testing::fixtures().join("torch_save");
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).unwrap()).unwrap();
    let got = read_torch_file(&dir.join("state.pt")).unwrap();
    let want = want.as_object().unwrap();
    assert_eq!(got.len(), want.len());
    for (name, t) in &got {
        let w = &want[name];
        let dtype = match t.dtype {
            TorchDType::F32 => "float32",
            TorchDType::BF16 => "bfloat16",
            TorchDType::I8 => "int8",
            TorchDType::I32 => "int32",
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(dtype, w["dtype"], "{name}");
        let shape: Vec<usize> = serde_json::from_value(w["shape"].clone()).unwrap();
        assert_eq!(t.shape, shape, "{name}");
        let values: Vec<f32> = serde_json::from_value(w["values"].clone()).unwrap();
        let got = t
            .to_tensor(DType::F32, &Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got, values, "{name}");
    }
}
