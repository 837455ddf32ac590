"""ferrotune's reward worker: imports a Python file of reward functions with TRL's signature
(`def reward(prompts, completions, **columns) -> list[float]`) and answers ferrotune's requests,
one JSON object a line on stdin, one JSON object a line on stdout (the protocol in ferrotune's
docs, recipes/grpo.md "Rewards users write"). What the functions print goes to stderr.

    python3 worker_driver.py FILE
"""
import importlib.util
import json
import math
import sys
import traceback


def short_error():
    """The exception's last traceback line, and the user file's frame it came from."""
    kind, value, tb = sys.exc_info()
    frames = [f for f in traceback.extract_tb(tb) if f.filename != __file__]
    where = ""
    if frames:
        f = frames[-1]
        where = " (%s, line %d, in %s)" % (f.filename, f.lineno, f.name)
    return "%s: %s%s" % (kind.__name__, value, where)


def call(fn, req, rows=None):
    prompts, completions, ids = req["prompts"], req["completions"], req["completion_ids"]
    columns = req.get("columns") or {}
    if rows is not None:
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        prompts, completions, ids = pick(prompts), pick(completions), pick(ids)
        columns = {k: pick(v) for k, v in columns.items()}
    return fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)


def answer(module, req):
    name = req.get("function")
    fn = getattr(module, name, None) if isinstance(name, str) else None
    if not callable(fn):
        return {"error": "the file has no function '%s'" % name}
    try:
        rewards = call(fn, req)
    except Exception:
        err = short_error()
        # The first row that fails on its own names the culprit.
        for row in range(len(req["completions"])):
            try:
                call(fn, req, [row])
            except Exception:
                return {"error": short_error(), "row": row}
        return {"error": err}
    try:
        rewards = list(rewards)
    except TypeError:
        return {"error": "returned %s, not a list of rewards" % type(rewards).__name__}
    out = []
    for row, r in enumerate(rewards):
        if r is None:
            out.append(None)
            continue
        try:
            v = float(r)
        except (TypeError, ValueError):
            return {"error": "returned %r, not a number" % (r,), "row": row}
        if math.isnan(v):
            out.append(None)
        elif math.isinf(v):
            return {"error": "returned %r, not a finite number" % (r,), "row": row}
        else:
            out.append(v)
    return {"rewards": out}


def main():
    path = sys.argv[1]
    protocol = sys.stdout
    sys.stdout = sys.stderr

    def send(obj):
        protocol.write(json.dumps(obj) + "\n")
        protocol.flush()

    try:
        spec = importlib.util.spec_from_file_location("ferrotune_rewards", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    except BaseException:
        send({"error": "importing %s: %s" % (path, short_error())})
        return
    send({"ready": True})
    for line in sys.stdin:
        if line.strip():
            send(answer(module, json.loads(line)))


if __name__ == "__main__":
    main()
