"""Write docs/op_models.md: every op TraceLens maps to a perf model or a category, and what tracefuse does with it.

Run it in an environment where TraceLens imports (a checkout of AMD-AGI/TraceLens on ``--tracelens``, or installed):

    python scripts/op_models_table.py --tracelens ../TraceLens > docs/op_models.md

tests/test_op_perf.py checks the table against ``tracefuse_dask.perf`` on every run, without TraceLens: an op the
table calls modelled has a model, an op it calls not modelled has none, and every op we model is in it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from tracefuse_dask import perf

_INTRO = """# Op models: TraceLens's and ours

`op_perf` gives each op group its FLOPs, bytes and roofline from a model of the op (`tracefuse_dask/perf`).
The models follow TraceLens's formulas (`PerfModel/perf_model.py` and its extensions), written anew. This table
lists every op TraceLens (commit {commit}) maps to a model or only to a category
(`TraceLens/PerfModel/torch_op_mapping.py`), and what tracefuse does with it. It is written by
`scripts/op_models_table.py`, and `tests/test_op_perf.py` holds it to the code.

How the two agree is tested on TraceLens's own tables of two traces (`tests/test_op_perf.py`): the same groups,
calls and categories, and `gflop`, `data_mib` and `kernel_us` within 1%, for every row TraceLens models.

No op that TraceLens models and we do not appears in any of the real traces of the project's real-trace test
corpus (the same test checks it): none could be checked against a real call, so none was guessed. Each row says
what it is and what a model of it needs.

## Where we differ from TraceLens, on purpose

- **Triton's fp32 bytes**, **`aten::mean`'s `dim`**, **FlashAttention backward's causal flag**, **batch norm's
  `training`** and **a convolution's bias**: TraceLens misreads the argument; each module's docstring says how.
- **Backward ops through their forward op** (TraceLens's autograd link): a backward op without a model of its own
  (CPU's `aten::_scaled_dot_product_flash_attention_for_cpu_backward` under
  `ScaledDotProductFlashAttentionForCpuBackward0`) takes the backward of its forward op's model, with the forward
  op's shapes. Its row has the autograd node's name, the forward op's inputs and the forward op's name as
  `context`. Only attention and convolution models have a backward, as in TraceLens (whose norm models declare a
  backward category, but their backward raises). We link a node to the latest op of its sequence number that has
  such a model, where TraceLens takes the latest op of that number on another thread and links only if that op
  has a model (on a CPU device the backward runs on the forward's thread; the op inside a forward op can carry its
  number). And a modelled op below the node (a copy) keeps its own row; TraceLens then gives every op below the
  node the whole backward.
- **`aiter::_flash_attn_backward`**: TraceLens reads its `dout, q, k` as `q, k, v`; we read `q, k, v`.
- **Nearest upsampling given scale factors** (the `.vec` overload): TraceLens's model fails; we take the size.
- **Symmetric-memory collectives** (`symm_mem::multimem_all_reduce_`, `one_shot_all_reduce`, `reduce_scatter_out`,
  ...; not its helpers such as `memset32_`): communication in the breakdown and the collectives tables, and left
  out of `op_perf` with the other collectives. TraceLens and HTA count their kernels as computation.
- **Element sizes**: attention backward's bytes (aiter's, varlen's) are at Q's element size, TraceLens's at 2
  bytes; the same for bf16 and fp16. Instance norm's `use_input_stats` is "True" or not, as batch norm's
  `training`.

## TraceLens's ops

"""

# Why an op TraceLens models has no model here, by TraceLens's model class, else by the module that holds it.
_WHY_CLASS = {
    "InstanceNormBwd": "no such op: PyTorch runs instance norm's backward as batch norm's (TraceLens's model raises)",
    "tev2_pseudo_gemm": "a pseudo op that TraceLens builds from Transformer Engine's kernels; no trace holds it",
    "ConvBias_": "NVIDIA apex's fused convolution: not yet (aten's convolutions are modelled)",
    "ConvBias_Backward": "NVIDIA apex's fused convolution: not yet (aten's convolutions are modelled)",
    "ConvBiasReLU_": "NVIDIA apex's fused convolution: not yet (aten's convolutions are modelled)",
    "ConvBiasReLU_Backward": "NVIDIA apex's fused convolution: not yet (aten's convolutions are modelled)",
    "FusedLnModulate": "Primus's fused LayerNorm and modulation: not yet",
    "FusedLnModulateBackward": "Primus's fused LayerNorm and modulation: not yet",
    "evoformer_attention": "DeepSpeed's Evoformer attention (its bias layouts): not yet",
    "moe_dispatch": "MoE token dispatch, communication: not yet",
    "moe_combine": "MoE token combine, communication: not yet",
    "causal_conv1d_fwd": "Mamba's causal conv1d: not yet",
    "mamba_ssd_fwd": "Mamba's state-space scan: not yet",
    "fused_rope_fwd": "Transformer Engine's fused RoPE: not yet",
    "cross_entropy_fwd": "Transformer Engine's fused cross entropy: not yet",
}
_WHY_MODULE = {
    "moe_perf_model_extensions": "MoE kernels: their work depends on the routing (tokens per expert), which each "
                                 "library records its own way; TraceLens builds several of them from kernel names. "
                                 "Not yet",
    "attention_perf_model_extensions": "inference attention (paged, ragged, MLA): its work depends on the KV cache's "
                                       "layout and the batch's lengths, read from the serving framework's "
                                       "annotations. Not yet; vLLM's unified attention is modelled",
    "custom_collectives_perf_model_extensions": "a custom all-reduce or all-gather: a collective, not yet "
                                                "recognised as one (`symm_mem::*` are)",
    "perf_model_extensions": "a vendor kernel (quantised GEMM, quantisation, fused activation, RoPE, mHC): not yet",
    "rmsnorm_perf_model_extensions": "a fused RMS norm with FP8/FP4 quantisation whose scales' layout varies: "
                                     "not yet",
    "perf_model": "a vendor GEMM or grouped GEMM (Transformer Engine, Primus, aiter, hipBLASLt): not yet",
}


def _ours(name: str) -> str:
    if perf.has_model(name):
        module = perf._model(name)[1].__module__.rsplit(".", 1)[-1]
        through = ", and the backward of an op linked to it" if perf.has_backward(name) else ""
        return f"modelled (`perf.{module}`{through})"
    return ""


def _why(cls: type, name: str) -> str:
    if name.startswith(("pseudo_", "pseudo_op::")):
        return "a pseudo op that TraceLens builds from kernel names in its tree; no trace holds it"
    return _WHY_CLASS.get(cls.__name__) or _WHY_MODULE[cls.__module__.rsplit(".", 1)[-1]]


def table(mapping) -> list[str]:
    head = ["| op | TraceLens's model | TraceLens's category | tracefuse |", "|---|---|---|---|"]
    rows = []
    for name, cls in sorted(mapping.op_to_perf_model_class_map.items()):
        ours = _ours(name) or f"not modelled: {_why(cls, name)}; in no shared trace"
        rows.append(f"| `{name}` | `{cls.__name__}` | {mapping.get_perf_model_category(cls)} | {ours} |")
    for name, cat in sorted(mapping.CATEGORY_ONLY_OP_MAPPING.items()):
        if name in mapping.op_to_perf_model_class_map:
            continue
        ours = _ours(name) or ("category only" if perf.category(name) == cat else
                               "not named: a pseudo op that TraceLens builds from kernel names; no trace holds it")
        rows.append(f"| `{name}` | (category only) | {cat} | {ours} |")
    return head + rows


def ours_only(mapping) -> list[str]:
    known = set(mapping.op_to_perf_model_class_map) | set(mapping.CATEGORY_ONLY_OP_MAPPING)
    rows = ["| op | tracefuse |", "|---|---|"]
    rows += [f"| `{name}` | {_ours(name)}, category {perf.category(name)} |" for name in sorted(perf._MODELS)
             if name not in known]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tracelens", help="a TraceLens checkout (else TraceLens must be installed)")
    parser.add_argument("--commit", help="the TraceLens commit to name (default: the checkout's HEAD)")
    args = parser.parse_args()
    commit = args.commit or "installed"
    if args.tracelens:
        sys.path.insert(0, args.tracelens)
        head = subprocess.run(["git", "-C", args.tracelens, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False).stdout.strip()
        commit = args.commit or head or "a checkout"
    try:
        from TraceLens.PerfModel import torch_op_mapping as mapping
    except ImportError as e:
        sys.exit(f"op_models_table.py: cannot import TraceLens's torch_op_mapping ({e}); pass --tracelens with a "
                 "checkout of AMD-AGI/TraceLens, in an environment with its dependencies, or install it")

    print(_INTRO.replace("{commit}", commit) + "\n".join(table(mapping)) +
          "\n\n## Modelled here, not by TraceLens\n\n" + "\n".join(ours_only(mapping)))


if __name__ == "__main__":
    main()
