"""One training step (forward and backward) of the Hugging Face Llama and Qwen3 modeling code,
unmodified, under torch.compile with and without kernelgate's compile hook: the second model
the compile hook's target is measured on (the first is bench_train_step.py's).

The models (default sizes, those of bench_train_step.py): transformers' LlamaForCausalLM and
Qwen3ForCausalLM, 8 layers, hidden 2048, 16 query and 4 kv heads of 128, MLP 5632, vocab 128256,
rms_norm eps 1e-6, SDPA attention, batch 4 x 2048 tokens, bfloat16, the same weights and batch in
every variant; the loss is the model's own (labels = the batch's targets). Variants:

  eager         the model as it is
  compile       torch.compile(model)
  compile_hook  torch.compile(model, options=kernelgate.compile.options()): the subgraphs that
                match kernelgate ops become those ops where evidence ranks a kernelgate kernel
                (as installed: the shipped evidence, no user store)

Per variant: step time (CUDA events, median after warm-up), tokens/s, peak memory, agreement with
eager (loss, every parameter's gradient); for the compiled variants the graphs and graph breaks
Dynamo made (they must be the same with and without the hook); for compile_hook what the hook
rewrote, what it left to Inductor and why, and which backend served each rewritten call.

    python bench/bench_hf_train_step.py --out bench/results/h200/hf_train_step.json
    python bench/bench_hf_train_step.py --tiny --device cpu --steps 1 --warmup 0 --hook-mode always  # a check
"""

import sys

import torch

from bench_train_step import hook_rewrites, measure_variants, run_variant, step_arguments, step_inputs, step_setup
from common import write_json

FULL = dict(layers=8, hidden=2048, heads=16, kv_heads=4, head_dim=128, mlp=5632, vocab=128256, batch=4, seq=2048)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, vocab=200, batch=2, seq=16)
MODELS = ("llama", "qwen3")


class Step(torch.nn.Module):
    """The model's loss on a batch: what the step runs (and compiles)."""

    def __init__(self, name, cfg):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

        config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[name]
        self.model = model(config(
            hidden_size=cfg["hidden"], intermediate_size=cfg["mlp"], num_hidden_layers=cfg["layers"],
            num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
            vocab_size=cfg["vocab"], max_position_embeddings=cfg["seq"], rms_norm_eps=1e-6,
            tie_word_embeddings=False, attn_implementation="sdpa"))

    def forward(self, ids, targets):
        return self.model(input_ids=ids, labels=targets, use_cache=False).loss


def with_graphs(run):
    """run(variant), with the graphs and graph breaks Dynamo made for a compiled variant."""
    from torch._dynamo.utils import counters

    def measured(variant):
        torch._dynamo.reset()
        counters.clear()
        r, grads = run(variant)
        if "compile" in variant:
            r["graphs"] = counters["stats"]["unique_graphs"]
            r["graph_breaks"] = sum(counters["graph_break"].values())
        return r, grads
    return measured


def main() -> int:
    ap = step_arguments("eager,compile,compile_hook")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--hook-mode", default="evidence", choices=["evidence", "always"],
                    help="the compile hook's mode: 'always' rewrites where evidence would not (a check "
                         "of the rewrites on the CPU, which has no evidence)")
    args = ap.parse_args()
    cfg, dev, dt, variants, env = step_setup(args, FULL, TINY)
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)} (known: {', '.join(MODELS)})")
    results = {}

    def record(rows):
        if args.out:
            write_json(args.out, {**env, "model": cfg, "dtype": str(dt).replace("torch.", ""),
                                  "warmup_steps": args.warmup, "timed_steps": args.steps,
                                  "evidence": "as installed", "hook_mode": args.hook_mode, "models": results})

    for name in models:
        print(f"== {name}", flush=True)
        state, ids, targets = step_inputs(lambda c: Step(name, c), cfg, dev, dt)
        rows = results[name] = []

        def record_model(model_rows, rows=rows):
            rows[:] = model_rows
            record(None)

        measure_variants(
            variants,
            with_graphs(lambda v: run_variant(v, cfg, state, ids, targets, dev, dt, args.warmup, args.steps,
                                              profile=dev.startswith("cuda") and v in args.profile.split(","),
                                              build=lambda v: Step(name, cfg), hook_mode=args.hook_mode)),
            hook_rewrites, record_model, peers=("compile",))
        hooked = {r["variant"]: r for r in rows}
        if "compile" in hooked and "compile_hook" in hooked and "graphs" in hooked["compile_hook"]:
            same = all(hooked["compile"].get(k) == hooked["compile_hook"].get(k) for k in ("graphs", "graph_breaks"))
            print(f"{name}: graphs and graph breaks with the hook {'the same as' if same else 'DIFFER from'} "
                  f"Inductor alone's", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
