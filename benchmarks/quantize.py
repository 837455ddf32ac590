"""The anchor for `ferrotune run quantize`: the same work in PyTorch + torchao, whole process.

Usage: python3 benchmarks/quantize.py HF_MODEL_DIR OUT.pt [--groupsize 64]

Loads the HF checkpoint with transformers (float32), replaces every linear layer whose input size is
a multiple of the group size by torchao's Int8DynActInt4WeightQATQuantizer (prepare + convert: the
int8 codes, scales and zeros torchtune's quantize recipe saves for 8da4w-qat) and writes the state
dict with torch.save. (torchtune's recipe also renames the tensors to its own names first; that is a
dictionary pass.) Prints the seconds of each phase.
"""
import argparse
import time

t0 = time.perf_counter()
import torch  # noqa: E402
from torchao.quantization.qat import Int8DynActInt4WeightQATQuantizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--groupsize", type=int, default=64)
    args = ap.parse_args()
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    t2 = time.perf_counter()
    q = Int8DynActInt4WeightQATQuantizer(groupsize=args.groupsize)
    with torch.no_grad():
        model = q.convert(q.prepare(model))
    t3 = time.perf_counter()
    torch.save(model.state_dict(), args.out)
    t4 = time.perf_counter()
    print(f"imports {t1 - t0:.2f} s, load {t2 - t1:.2f} s, quantize {t3 - t2:.2f} s, save {t4 - t3:.2f} s")


if __name__ == "__main__":
    main()
