# ferrotune's bridge to the official W&B (`wandb`) and Comet (`comet_ml`) clients, run as
# `python -c` by crates/ferrotune-train/src/metrics/bridge.rs. It reads JSON lines on stdin:
#   {"tracker": "wandb"|"comet", "options": {...}}   first: starts the run
#   {"type": "config", "config": {...}}              the resolved config
#   {"type": "log", "step": N, "metrics": {...}}     one step's metrics
#   {"type": "finish"}                               ends the run
# and answers each with one JSON line, {"ok": ...} or {"error": "..."}, on the stdout it was
# started with. The clients' own printing goes to stderr, so it cannot corrupt the answers.
# The calls are torchtune 0.6.1's (torchtune/training/metric_logging.py).
import json
import os
import sys

answers = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def answer(**kw):
    answers.write(json.dumps(kw) + "\n")
    answers.flush()


def error(e):
    answer(error=f"{type(e).__name__}: {e}")


class Wandb:
    def __init__(self, o):
        import wandb

        self.wandb = wandb
        kwargs = {k: v for k, v in o.items() if k not in ("project", "entity", "group", "log_dir")}
        log_dir = kwargs.pop("dir", o.get("log_dir"))
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        self.allow_val_change = kwargs.get("allow_val_change", False)
        self.run = wandb.init(
            project=o.get("project") or "torchtune",
            entity=o.get("entity"),
            group=o.get("group"),
            dir=log_dir,
            **kwargs,
        )
        wandb.define_metric("global_step")
        wandb.define_metric("*", step_metric="global_step", step_sync=True)

    def where(self):
        if self.run.settings._offline:
            return "W&B offline run " + os.path.dirname(self.run.dir)
        return "W&B run " + (self.run.url or self.run.id)

    def config(self, config):
        self.wandb.config.update(config, allow_val_change=self.allow_val_change)

    def log(self, step, metrics):
        self.wandb.log({**metrics, "global_step": step})

    def finish(self):
        self.wandb.finish()


class Comet:
    def __init__(self, o):
        import comet_ml

        online = o.get("online")
        config = {"log_code": o.get("log_code", True), "tags": o.get("tags"),
                  "name": o.get("experiment_name")}
        if online is False and o.get("log_dir") is not None:
            os.makedirs(o["log_dir"], exist_ok=True)
            config["offline_directory"] = o["log_dir"]
        self.experiment = comet_ml.start(
            api_key=o.get("api_key"),
            workspace=o.get("workspace"),
            project=o.get("project"),
            experiment_key=o.get("experiment_key"),
            mode=o.get("mode"),
            online=online,
            experiment_config=comet_ml.ExperimentConfig(**config),
        )
        self.offline = online is False

    def where(self):
        if self.offline:
            return "Comet offline experiment in " + str(self.experiment.offline_directory)
        return "Comet experiment " + str(self.experiment.url)

    def config(self, config):
        self.experiment.log_parameters(config)

    def log(self, step, metrics):
        self.experiment.log_metrics(metrics, step=step)

    def finish(self):
        self.experiment.end()


def main():
    first = json.loads(sys.stdin.readline() or "{}")
    try:
        tracker = {"wandb": Wandb, "comet": Comet}[first.get("tracker")](first.get("options", {}))
        answer(ok=tracker.where())
    except BaseException as e:  # a missing package included: the run goes on without it
        error(e)
        return
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            kind = msg.get("type")
            if kind == "config":
                tracker.config(msg["config"])
            elif kind == "log":
                tracker.log(msg["step"], msg["metrics"])
            elif kind == "finish":
                tracker.finish()
                answer(ok="finished")
                return
            answer(ok=True)
        except BaseException as e:
            error(e)


main()
