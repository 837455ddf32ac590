"""What TRL's trainer fixture scripts share (make_kto_fixtures.py, make_reward_model_fixtures.py):
the tiny models loaded in f32 with eager attention, and a trainer's config for one step of plain
SGD on one device batch (lr 1, no clipping, constant schedule, no weight decay, CPU, f32, the rows
in order, logged, nothing saved or reported), the step each golden records.

Imported by the scripts (run from the repository root as `python scripts/make_*.py`, their folder
is on `sys.path`); not run itself.
"""
import torch

# Everything of the config but the output folder, the batch size and the case's own settings.
ONE_STEP = dict(
    gradient_accumulation_steps=1,
    max_steps=1,
    learning_rate=1.0,
    optim="sgd",
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=0.0,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    bf16=False,
    save_strategy="no",
    train_sampling_strategy="sequential",
)


def one_step_config(config_class, output_dir, batch_size, **settings):
    """`config_class` (`KTOConfig`, `RewardConfig`, ...) for one SGD step over `batch_size` rows
    in one device batch, with the case's `settings` (its loss and their knobs)."""
    return config_class(output_dir=output_dir, per_device_train_batch_size=batch_size, **ONE_STEP,
                        **settings)


def load_f32(auto_class, path, **kwargs):
    """A tiny fixture model through `auto_class` (`AutoModelForCausalLM`, ...): f32, eager
    attention."""
    return auto_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs)
