"""Quick recovery trials that chose the training defaults (batch size, learning rate, data mix).

Each trial trains one rank-16 adapter on a checkpoint with RecoverConfig defaults overridden by the trial's
fields and prints held-out perplexity (8 x 512 tokens of Shakespeare = out-of-domain, of the Python-docs eval
split = in-domain) and the fraction of the quantization gap closed, midway (``evals``) and at the end.
reports/recover-tuning.md holds the trials that set the defaults and what each showed.

    python benchmarks/recover_tuning.py CHECKPOINT '[{"name": "b4", "batch_size": 4, "lr": 1e-3, "tokens": 16384,
                                                      "evals": [8192]}]'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from recover import shakespeare_dir  # noqa: E402

from qrecover import api  # noqa: E402
from qrecover.models import load_model  # noqa: E402
from qrecover.recovery.api import recover  # noqa: E402
from qrecover.recovery.config import RecoverConfig  # noqa: E402


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ckpt, trials = Path(sys.argv[1]), json.loads(sys.argv[2])
    out = ROOT / "benchmarks" / "out" / "tuning"
    texts = {"ood": shakespeare_dir(), "in": "python-docs"}
    teacher, tok, _ = load_model(None)

    def ppl(model) -> dict[str, float]:
        return {k: api.perplexity(model, tok, s, windows=8, seq_len=512, show_progress=False)["ppl"] for k, s in texts.items()}

    original, quantized = ppl(teacher), ppl(api.load(ckpt, cache=True))
    print("original", original, "quantized", quantized, flush=True)

    def closed(p: dict[str, float]) -> dict[str, float]:
        return {k: round((quantized[k] - p[k]) / (quantized[k] - original[k]), 3) for k in p}

    for trial in trials:
        name, evals = trial.pop("name"), trial.pop("evals", [])
        cfg = RecoverConfig(checkpoint_every=0, **trial)

        def midway(info, name=name, evals=evals):
            if info["tokens"] in evals:
                p = ppl(info["model"])
                info["model"].train()
                print(name, info["tokens"], p, closed(p), flush=True)

        t = time.time()
        meta = recover(ckpt, out / name, cfg, overwrite=True, teacher=teacher, show_progress=False, callback=midway)
        p = ppl(api.load(ckpt, cache=True, adapter=out / name))
        print("RESULT", name, trial, p, closed(p), "tok/s", round(meta["training"]["tok_per_s"], 1),
              meta["training"]["mixed_precision"], "wall", round(time.time() - t), flush=True)


if __name__ == "__main__":
    main()
