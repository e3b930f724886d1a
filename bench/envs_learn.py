"""Held-out success of a model on a shipped environment, through the multi-turn driver on the
local engine (what `sat eval <env>` measures, without the MLflow run): docs/environments.md,
"Measured"; bench/README.md, "Environments learned by the embedded model".

    python bench/envs_learn.py guess runs/cache/guess_warm-<hash> [--n 8] [--rows 100]
    python bench/envs_learn.py guess <run>/checkpoints/step_60/trainer/model

The environment's compact format (``parser=compact``), 4 turns, 128 tokens, temperature 1,
24 new tokens per turn, the engine seeded 0 and the requests 7919: the same numbers for the
same model on the same machine.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("env", choices=["calculator", "guess"])
    ap.add_argument("model", help="an HF checkpoint folder")
    ap.add_argument("--n", type=int, default=8, help="trajectories per held-out row")
    ap.add_argument("--rows", type=int, default=100, help="held-out rows")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    if args.json:  # checked before the work (sat_cli.util.script_args)
        from sat_cli.util.script_args import output_file

        args.json = str(output_file("bench/envs_learn.py", args.json, "--json"))

    from sat_cli.engines.base import SamplingParams
    from sat_cli.engines.local import LocalEngine, LocalEngineRuntime, LocalEngineSettings
    from sat_cli.envs.base import EnvSettings
    from sat_cli.envs.registry import ENVIRONMENTS
    from sat_cli.envs.trajectory import TrajectorySettings
    from sat_cli.evaluation.envs import evaluate_env, format_summary
    from sat_cli.models.tiny_moe import load_tokenizer

    tok = load_tokenizer(args.model)
    rows = ENVIRONMENTS.get(args.env).rows("heldout", args.rows)
    sampling = SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=24,
        stop_token_ids=(tok.eos_token_id,),
        seed=7919,
    )
    t0 = time.perf_counter()
    with LocalEngine(LocalEngineSettings(), LocalEngineRuntime(args.model, seed=0)) as engine:
        res = evaluate_env(
            engine,
            tok,
            args.env,
            EnvSettings(4, 128, "compact"),
            TrajectorySettings(4, 128),
            rows,
            args.n,
            sampling,
            64,
        )
    print(format_summary(args.env, args.n, res.summary))
    print(f"{time.perf_counter() - t0:.1f} s; first trajectories: {res.samples[:3]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, **res.summary}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
