"""The op performance models (tracefuse_dask.perf) against values computed by hand, family by family, including
broadcasting and backward passes; and the device table: every device has a cited source and sane peaks, and the
devices of the shared real traces are told apart."""
from __future__ import annotations

import json

import pytest

from tracefuse_dask.perf import (
    backward_category,
    backward_work,
    category,
    has_backward,
    work,
)
from tracefuse_dask.perf.devices import detect, load_devices

BF16, F32 = "c10::BFloat16", "float"


def w(name: str, dims: list, types: list, concrete: list | None = None):
    return work(name, json.dumps(dims), json.dumps(types), json.dumps(concrete or [""] * len(dims)))


def test_gemms():
    mm = w("aten::mm", [[8944, 1024], [1024, 2816]], [BF16, BF16])
    assert (mm.flops, mm.precision, mm.unit) == (2 * 8944 * 2816 * 1024, "bf16", "matrix")
    assert mm.bytes == (8944 * 1024 + 1024 * 2816 + 8944 * 2816) * 2
    addmm = w("aten::addmm", [[1024], [8944, 1024], [1024, 1024], [], []], [BF16] * 3 + ["Scalar"] * 2)
    assert addmm.flops == 2 * 8944 * 1024 * 1024 + 8944 * 1024
    assert addmm.bytes == (8944 * 1024 + 1024 * 1024 + 8944 * 1024 + 1024) * 2  # the bias as one row
    bmm = w("aten::bmm", [[4, 32, 16], [4, 16, 8]], [F32, F32])
    assert (bmm.flops, bmm.bytes) == (4 * 2 * 32 * 8 * 16, 4 * (32 * 16 + 16 * 8 + 32 * 8) * 4)
    baddbmm = w("aten::baddbmm", [[4, 32, 8], [4, 32, 16], [4, 16, 8]], [F32] * 3)
    assert baddbmm.flops == 4 * (2 * 32 * 8 * 16 + 32 * 8)
    fp8 = w("aten::_scaled_mm", [[64, 128], [128, 32], [], []], ["c10::Float8_e4m3fn"] * 2 + [F32, F32])
    assert (fp8.bytes, fp8.precision) == (64 * 128 + 128 * 32 + 64 * 32 * 2, "fp8")  # fp8 in, 2-byte out
    assert category("aten::mm") == "GEMM" and w("aten::mm", [[8, 4]], [BF16]) is None  # a shape it does not take


def test_attention_forward_and_backward():
    q = [16, 16, 559, 64]
    fwd = w("aten::_scaled_dot_product_flash_attention", [q, q, q, [], [], [], []], [BF16] * 3 + ["Scalar"] * 4,
            ["", "", "", "0.", "True", "False", "0.125"])
    full = 2 * 16 * 16 * (2 * 559 * 559 * 64)
    assert (fwd.flops, fwd.bytes) == (full / 2, 4 * 16 * 16 * 559 * 64 * 2)  # causal halves it
    assert category("aten::_scaled_dot_product_flash_attention") == "SDPA_fwd"
    # GQA backward, not causal: 8 query heads on 2 KV heads
    qh, kv = [2, 8, 128, 64], [2, 2, 128, 64]
    concrete = [""] * 11 + ["False"]
    bwd = w("aten::_scaled_dot_product_flash_attention_backward", [qh, qh, kv, kv, qh, [2, 8, 128]],
            [BF16] * 5 + [F32], concrete)
    gemm = 2 * 8 * 2 * 128 * 128 * 64
    assert bwd.flops == 5 * gemm + 2 * (2 * 128 * 64 * 3)  # recompute, dV, dP, dQ, dK; the GQA reductions
    assert bwd.bytes == 2 * 2 * (128 * 8 * 64 * 3 + 128 * 2 * 64 * 4)  # Q, dO, dQ; K, V, dK, dV
    assert category("aten::_scaled_dot_product_flash_attention_backward") == "SDPA_bwd"
    flash = w("FlashAttnFunc", [[2, 128, 8, 64]] * 3, [BF16] * 3, ["", "", "", "0.0", "0.125", "False"])
    assert flash.flops == 2 * 2 * 8 * 2 * 128 * 128 * 64  # (batch, length, heads, dim)


def test_elementwise_broadcasting_and_types():
    mul = w("aten::mul", [[16, 559, 1024], [16, 559, 1]], [F32, F32])
    n = 16 * 559 * 1024
    assert (mul.flops, mul.bytes, mul.unit) == (n, n * 4 + 16 * 559 * 4 + n * 4, "vector")
    rope = w("aten::mul", [[16, 16, 559, 64], [1, 1, 559, 64]], [BF16, BF16])
    assert rope.flops == 16 * 16 * 559 * 64 and rope.bytes == (16 * 16 * 559 * 64 * 2 + 559 * 64) * 2
    scalar = w("aten::add", [[16, 559, 1], [], []], [F32, "double", "Scalar"], ["", "", "1"])
    assert scalar.bytes == 8944 * 4 + 8 + 8944 * 4  # a 0-d operand: one element, the output at the tensor's size
    mixed = w("aten::mul", [[4, 4], [4, 4]], [BF16, F32])
    assert mixed.bytes == 16 * 2 + 16 * 4 + 16 * 4  # both tensors: the output at the larger size
    copy = w("aten::copy_", [[16, 559, 1024], [16, 559, 1024], []], [F32, BF16, "Scalar"], ["", "", "False"])
    assert (copy.flops, copy.bytes) == (n, n * 4 + n * 2)
    assert w("aten::mul", [[3, 4], [5, 4]], [F32, F32]) is None  # shapes that do not broadcast


def test_reductions_read_dim_and_keepdim():
    mean = w("aten::mean", [[16, 559, 1024], [], [], []], [F32, "ScalarList", "Scalar", ""], ["", "[-1]", "True", ""])
    assert (mean.flops, mean.bytes) == (16 * 559 * 1024, (16 * 559 * 1024 + 16 * 559) * 4)
    total = w("aten::sum", [[8, 4], [], []], [F32, "ScalarList", "Scalar"], ["", "[0, 1]", "False"])
    assert total.bytes == (32 + 1) * 4
    no_dim = w("aten::sum", [[8, 4], []], [F32, ""], ["", ""])
    assert no_dim.bytes == (32 + 1) * 4
    cumsum = w("aten::cumsum", [[8, 4], [], []], [F32, "Scalar", ""], ["", "1", ""])
    assert cumsum.bytes == 64 * 4


def test_norms_and_softmax():
    ln = w("aten::native_layer_norm", [[8, 128, 512], [], [512], [512], []], [BF16, "ScalarList", BF16, BF16, "Scalar"],
           ["", "[512]", "", "", "1e-05"])
    n, c = 8 * 128 * 512, 512
    assert ln.flops == 6 * c + 3 * n + 2 * n and ln.bytes == 2 * n * 2 + 6 * c * 2
    assert category("aten::native_layer_norm") == "NORM_fwd"
    lnb = w("aten::native_layer_norm_backward", [[8, 128, 512], [8, 128, 512], [], [8, 128, 1], [8, 128, 1], [512],
                                                 [512], []],
            [BF16, BF16, "ScalarList", F32, F32, BF16, BF16, "ScalarList"], ["", "", "[512]", "", "", "", "",
                                                                            "[True, True, True]"])
    per = n / c
    assert lnb.flops == c * (4 * per + 5 * per)
    assert lnb.bytes == n * 2 + n * 2 * 2 + c * 2 + c * 2 + c * 2 * 2
    assert category("aten::native_layer_norm_backward") == "NORM_bwd"
    rms = w("aten::_fused_rms_norm", [[8, 128, 512], [], [512], []], [BF16, "ScalarList", BF16, "Scalar"],
            ["", "[512]", "", ""])
    assert rms.flops == n / c * (2 * c + 2) + 2 * n and rms.bytes == 2 * n * 2 + c * 2
    bn = w("aten::native_batch_norm", [[4, 64, 8, 8], [64], [64], [64], [64], [], [], []],
           [F32] * 5 + ["Scalar"] * 3, ["", "", "", "", "", "True", "0.1", "1e-05"])
    n = 4 * 64 * 64
    assert bn.flops == 64 * 6 + 3 * n + 2 * n and bn.bytes == 2 * n * 4 + 6 * 64 * 4
    sm = w("aten::_softmax", [[4, 1024], [], []], [BF16, "Scalar", "Scalar"], ["", "-1", "False"])
    assert (sm.flops, sm.bytes) == (3 * 4096, 2 * 4096 * 2)


def test_convolutions_forward_and_backward():
    x, wt = [8, 3, 32, 32], [16, 3, 3, 3]
    fwd = w("aten::convolution", [x, wt, [16], [], [], [], [], [], []], [F32] * 3 + ["ScalarList"] * 3 + ["Scalar",
                                                                                                   "ScalarList",
                                                                                                   "Scalar"],
            ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"])
    out = 8 * 16 * 32 * 32  # padding 1 keeps 32x32
    assert fwd.flops == out * 2 * 27 + out
    assert fwd.bytes == (8 * 3 * 32 * 32 + 16 * 27 + 16 + out) * 4
    strided = w("aten::convolution", [x, wt, [], [], [], [], [], [], []], [F32] * 2 + [""] * 7,
                ["", "", "", "[2]", "[0]", "[1]", "False", "[0]", "1"])
    assert strided.flops == 8 * 16 * 15 * 15 * 2 * 27  # (32 - 3) / 2 + 1 = 15, no bias
    bwd = w("aten::convolution_backward", [[8, 16, 32, 32], x, wt, [], [], [], [], [], [], [], []],
            [F32] * 3 + [""] * 8, ["", "", "", "[16]", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1",
                                   "[True, True, False]"])
    assert bwd.flops == 8 * 3 * 32 * 32 * 2 * (16 * 9) + 16 * 3 * 3 * 3 * 2 * (8 * 32 * 32)
    assert category("aten::convolution_backward") == "CONV_bwd"


def test_categories_without_a_model():
    assert category("aten::cat") == "other"
    assert category("triton_poi_fused_add_0") == "triton"
    assert category("aten::fill_", "void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert category("aten::_efficient_attention_backward") == "SDPA_bwd"


def test_every_device_has_a_source_and_the_real_traces_devices_are_told_apart():
    devices = load_devices()
    for d in devices:
        assert d.source.startswith(("NVIDIA", "AMD")) and "https://" in d.source, d.name
        assert d.memory_tb_s > 0 and (d.matrix or d.vector), d.name
        assert all(0 < v < 20000 for v in (*d.matrix.values(), *d.vector.values())), d.name
    names = {d.name.split("-")[0] for d in devices}
    assert {"V100", "A100", "H100", "H200", "B200", "GB200", "MI250X", "MI300X", "MI325X", "MI355X", "L4",
            "L40S"} <= names
    seen = {("NVIDIA A100-PG509-200", 39.4, 108): "A100-SXM4-40GB", ("NVIDIA A100-SXM4-80GB", 79.2, 108):
            "A100-SXM4-80GB", ("NVIDIA H100 80GB HBM3", 79.2, 132): "H100-SXM5", ("NVIDIA H100", 95.1, 132):
            "H100-NVL", ("AMD Instinct MI300X VF", 191.5, 304): "MI300X", ("", 192.0, 304): "MI300X",
            ("NVIDIA B200", 178.4, 148): "B200", ("AMD Radeon Graphics", 64.0, 104): "MI250-GCD",
            ("Tesla V100-DGXS-32GB", 31.7, 80): "V100-SXM2", ("ARTEMIS", 0.0, None): None}
    for (name, gib, sms), want in seen.items():
        got, called = detect([{"name": name, "totalGlobalMem": int(gib * 2**30), "numSms": sms}], devices)
        assert (got.name if got else None, called) == (want, name)
    h100 = next(d for d in devices if d.name == "H100-SXM5")
    assert h100.roof("matrix", "fp32") == ("matrix tf32", 494.5)  # an fp32 GEMM may run on the TF32 tensor cores
    assert h100.roof("vector", "bf16") == h100.roof("vector", "fp32") == ("vector fp32", 67)  # no 16-bit vector figure
    assert h100.roof("vector", "fp64") == ("vector fp64", 34) and h100.roof("matrix", "fp64") == ("matrix fp64", 67)
    assert h100.roof("matrix", None) is None
    mi300 = next(d for d in devices if d.name == "MI300X")
    assert mi300.roof("matrix", "fp32") == ("matrix fp32", 163.4) and mi300.roof("matrix", "fp64")[1] == 163.4


def test_a_gpu_spec_file_adds_and_overrides_devices(tmp_path):
    spec = tmp_path / "gpus.json"
    spec.write_text(json.dumps({"devices": [{"name": "H100-mine", "match": [{"name": "H100"}], "matrix": {"bf16": 900},
                                             "vector": {"fp32": 60}, "memory_tb_s": 3.0, "source": "measured"}]}))
    d, _ = detect([{"name": "NVIDIA H100 80GB HBM3"}], load_devices(str(spec)))
    assert (d.name, d.roof("matrix", "bf16"), d.memory_tb_s) == ("H100-mine", ("matrix bf16", 900), 3.0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": [{"name": "x"}]}')
    from tracefuse_dask.errors import TraceFuseError

    with pytest.raises(TraceFuseError, match="bad.json: not a device table"):
        load_devices(str(bad))


def test_argument_positions_of_the_ops_that_read_them():
    """The positions each op's signature gives: group_norm's weight after num_groups, FlashAttention backward's
    causal after the softmax scale, a norm reduction's dim after p, sum's dtype overload, max's int dim, and the
    vendor batch norms."""
    x = [8, 32, 4, 4]
    affine = w("aten::group_norm", [x, [], [32], [32], [], []], [F32, "Scalar", F32, F32, "Scalar", "Scalar"],
               ["", "4", "", "", "1e-05", "True"])
    plain = w("aten::group_norm", [x, [], [], [], [], []], [F32, "Scalar", "", "", "Scalar", "Scalar"],
              ["", "4", "", "", "1e-05", "True"])
    assert affine.bytes - plain.bytes == 2 * 32 * 4  # weight and bias
    q = [2, 128, 8, 64]
    args = [q, q, q, q, q, [2, 8, 128], q, q, q, [], [], [], []]
    causal, full = (w("flash_attn::_flash_attn_backward", args, [BF16] * 9 + ["Scalar"] * 4,
                      [""] * 9 + ["0.0", "0.125", c, "-1"]) for c in ("True", "False"))
    assert full.flops == 2 * causal.flops
    norm = w("aten::norm", [[4, 8, 16], [], [], []], [F32, "Scalar", "ScalarList", "Scalar"], ["", "2", "[1]", "False"])
    assert norm.bytes == (4 * 8 * 16 + 4 * 16) * 4
    assert w("aten::sum", [[4, 8], []], [F32, "Scalar"], ["", "6"]).bytes == (32 + 1) * 4  # 6 is a dtype
    assert w("aten::max", [[4, 8], [], []], [F32, "Scalar", "Scalar"], ["", "1", "False"]).bytes == (32 + 4) * 4
    bn = w("aten::cudnn_batch_norm_backward", [[4, 64, 8, 8], [4, 64, 8, 8], [64], [64], [64], [64], [64], []],
           [F32] * 7 + ["Scalar"], [""] * 7 + ["1e-05"])
    assert category("aten::cudnn_batch_norm_backward") == "NORM_bwd" and bn.flops == 64 * (3 + 4 * 256)  # inference


def test_triton_kernels_from_what_the_trace_records():
    """Element counts from the concrete inputs, FLOPs from the fused ops in the name, bytes at the sizes of the
    types as a trace spells them (``float``, not TraceLens's ``c10::Float``)."""
    t = w("triton_poi_fused_add_mul_0", [[4, 8], [4, 8], []], [F32, F32, "Scalar"], ["", "", "32"])
    assert (t.flops, t.bytes, t.precision) == (64, 32 * 4 * 3, "fp32")
    red = w("triton_red_fused_mean_pow_1", [[16, 1], [16, 64], [], []], [BF16, BF16, "Scalar", "Scalar"],
            ["", "", "16", "64"])
    assert red.flops == 16 * 64 * 3 and red.bytes == (16 + 16 * 64) * 2
    copy = w("triton_poi_fused__to_copy_0", [[16], [16], []], [BF16, F32, "Scalar"], ["", "", "16"])
    assert copy.flops == 0 and copy.bytes == 16 * 2 + 16 * 4 + 16 * 2


def test_vllm_attention_reads_its_batch_from_vllms_annotation():
    """The shapes of vllm::unified_attention_with_output say nothing of the batch; vLLM's annotation around the
    step does (the real B200 trace's: one prefill of 888 tokens whose squares sum to 788544)."""
    import orjson

    from tracefuse_dask.perf import needs_context

    args = ([[888, 8, 64], [888, 1, 64], [888, 1, 64], [888, 8, 64], [], [], []], [BF16] * 4 + [""] * 3, [""] * 7)
    texts = [orjson.dumps(a).decode() for a in args]
    prefill = work("vllm::unified_attention_with_output", *texts, "execute_context_1(888_788544)_generation_0(0)")
    assert (prefill.flops, prefill.bytes, prefill.unit) == (8 * 2 * 788544 * 128, 888 * (512 + 64 + 64 + 512) * 2,
                                                             "matrix")
    mixed = work("vllm::unified_attention_with_output", *texts, "execute_context_1(888_788544)_generation_3(3)")
    assert mixed.flops == 8 * 2 * (788544 + 3) * 128
    assert work("vllm::unified_attention_with_output", *texts, "execute_context_0(0_0)_generation_4(4)") is None
    assert work("vllm::unified_attention_with_output", *texts) is None  # no annotation: no model
    assert needs_context("vllm::unified_attention_with_output") and category("vllm::unified_attention_with_output") \
        == "SDPA_fwd"


def test_a_vendor_gemm_with_linears_arguments():
    """vLLM's ROCm GEMM, as the real vLLM MI300X trace records it: (x, weight, bias) as F.linear takes them."""
    g = w("vllm::rocm_unquantized_gemm", [[32, 2880], [5120, 2880], [5120]], [BF16] * 3)
    assert (g.flops, g.bytes) == (2 * 32 * 5120 * 2880 + 32 * 5120, (32 * 2880 + 2880 * 5120 + 32 * 5120 + 5120) * 2)
    assert category("vllm::rocm_unquantized_gemm") == "GEMM"


def test_nearest_upsampling_and_replication_padding():
    x = [1, 512, 64, 64]  # an SD3.5 VAE decoder's upsample: 64x64 to 128x128, bf16
    n_in, n_out = 512 * 64 * 64, 512 * 128 * 128
    sized = w("aten::upsample_nearest2d", [x, [], [], []], [BF16, "ScalarList", "Scalar", "Scalar"],
              ["", "[128, 128]", "", ""])
    assert (sized.flops, sized.bytes, sized.unit) == (n_out, (n_in + n_out) * 2, "vector")
    scaled = w("aten::upsample_nearest2d", [x, [], []], [BF16, "", "ScalarList"], ["", "", "[2.0, 2.0]"])
    assert (scaled.flops, scaled.bytes) == (sized.flops, sized.bytes)  # the .vec overload: output size by factor
    one = w("aten::upsample_nearest1d", [[2, 8, 10], [], []], [F32, "ScalarList", "Scalar"], ["", "[25]", ""])
    assert (one.flops, one.bytes) == (2 * 8 * 25, (2 * 8 * 10 + 2 * 8 * 25) * 4)
    assert w("aten::upsample_nearest2d", [x, [], []], [BF16, "", ""], ["", "", ""]) is None  # no size, no factor
    pad = w("aten::replication_pad2d", [[1, 4, 10, 20], []], [F32, "ScalarList"], ["", "[1, 2, 3, 4]"])
    out = 1 * 4 * (10 + 3 + 4) * (20 + 1 + 2)  # pairs innermost first: W gets 1 + 2, H gets 3 + 4
    assert (pad.flops, pad.bytes) == (out, (4 * 10 * 20 + out) * 4)
    assert category("aten::upsample_nearest3d") == "elementwise" == category("aten::replication_pad1d")


def test_fused_rms_norms_and_aiters_group_norm():
    n, c = 888 * 2880, 2880  # the shapes of the B200 trace's vLLM norms
    rows = n // c
    plain = rows * (2 * c + 2) + 2 * n
    vllm = w("_C::rms_norm", [[888, 2880], [888, 2880], [2880], []], [BF16] * 3 + ["Scalar"])
    assert (vllm.flops, vllm.bytes, vllm.precision) == (plain, 2 * n * 2 + c * 2, "bf16")
    added = w("_C::fused_add_rms_norm", [[888, 2880], [888, 2880], [2880], []], [BF16] * 3 + ["Scalar"])
    assert (added.flops, added.bytes) == (plain + n, 4 * n * 2 + c * 2)  # input, residual read; both written
    aiter = w("aiter::rms_norm", [[888, 2880], [2880], [], []], [BF16, BF16, "Scalar", "Scalar"])
    assert (aiter.flops, aiter.bytes) == (vllm.flops, vllm.bytes)
    ck = w("aiter::rmsnorm2d_fwd_with_add_ck", [[888, 2880]] * 4 + [[2880], [], []], [BF16] * 5 + ["Scalar"] * 2)
    assert (ck.flops, ck.bytes) == (added.flops, added.bytes)
    quant = w("aiter::rmsnorm2d_fwd_with_dynamicquant_ck", [[888, 2880], [888, 2880], [888, 1], [2880], [], []],
              ["c10::Float8_e4m3fnuz", BF16, F32, BF16, "Scalar", "Scalar"])
    assert (quant.flops, quant.bytes) == (plain + 2 * n, n * 2 + c * 2 + n * 1 + rows * 4)
    assert {category(o) for o in ("_C::rms_norm", "aiter::add_rmsnorm", "aiter::rmsnorm")} == {"RMSNorm"}
    x = [1, 512, 64, 64]
    gn = w("aiter::_groupnorm_run", [x, [], [512], [512], []], [BF16, "Scalar", BF16, BF16, "Scalar"],
           ["", "32", "", "", "1e-06"])
    m = 512 * 64 * 64
    assert (gn.flops, gn.bytes) == (512 * 6 + 3 * m + 2 * m, 2 * m * 2 + 6 * 512 * 2)  # as aten::group_norm
    new = w("aiter::_groupnorm_run", [x, [4096], x, [], [512], [512], []],  # y, workspace, input, ...: aiter 2026
            [BF16, "float", BF16, "Scalar", BF16, BF16, "Scalar"], ["", "", "", "32", "", "", "1e-06"])
    assert (new.flops, new.bytes) == (gn.flops, gn.bytes)
    no_weight = w("aiter::_groupnorm_run", [x, [4096], x, [], [], [], []], [BF16, "float", BF16] + ["Scalar"] * 4)
    assert no_weight.bytes == 2 * m * 2 + 4 * 512 * 2  # mean, variance and the two running statistics
    assert category("aiter::_groupnorm_run") == "NORM_fwd"
    inst = w("aten::instance_norm", [[2, 8, 16, 16], [8], [8], [], [], [], [], [], []],
             [F32] * 3 + [""] * 2 + ["Scalar"] * 4, ["", "", "", "", "", "True", "0.1", "1e-05", "False"])
    k = 2 * 8 * 256
    assert (inst.flops, inst.bytes) == (8 * 6 + 3 * k + 2 * k, 2 * k * 4 + 6 * 8 * 4)


def test_flash_attention_varlen_forward_and_backward():
    # 4 sequences packed into 1000 tokens, the longest 400: one of 400 and three of (1000 - 400) // 3 = 200
    qkv = [[1000, 16, 128]] * 3
    fwd = w("flash_attn::_flash_attn_varlen_forward", qkv + [[5], [5]] + [[]] * 5,
            [BF16] * 3 + ["int", "int"] + ["Scalar"] * 5, [""] * 5 + ["400", "400", "0.0", "0.088", "True"])
    per = 16 * 2 * 2 * 128  # QKᵀ and PV per query-key pair, all heads
    assert fwd.flops == (400 * 400 * per + 3 * 200 * 200 * per) / 2  # causal halves each
    assert (fwd.bytes, fwd.unit) == (4 * 1000 * 16 * 128 * 2, "matrix")  # q, k, v read and o written
    bwd = w("flash_attn::_flash_attn_varlen_backward", [[1000, 16, 128]] * 5 + [[16, 1000]] + [[1000, 16, 128]] * 3
            + [[5], [5]] + [[]] * 5, [BF16] * 5 + [F32] + [BF16] * 3 + ["int", "int"] + ["Scalar"] * 5,
            [""] * 11 + ["400", "400", "0.0", "0.088", "False"])
    assert bwd.flops == (400 * 400 + 3 * 200 * 200) * 16 * 2 * 128 * 5  # recompute, dV, dP, dQ, dK; not causal
    assert bwd.bytes == 7 * 1000 * 16 * 128 * 2  # q, k, v, dO read; dq, dk, dv written
    assert category("flash_attn::_flash_attn_varlen_backward") == "SDPA_bwd"


def test_the_backward_of_a_forward_ops_model():
    q = [2, 4, 64, 32]
    args = (json.dumps([q, q, q, [], [], [], [], []]), json.dumps([F32] * 3 + ["Scalar"] * 5),
            json.dumps(["", "", "", "", "", "0.0", "True", ""]))
    assert has_backward("aten::_scaled_dot_product_efficient_attention")
    bwd = backward_work("aten::_scaled_dot_product_efficient_attention", *args)
    gemm = 2 * 4 * 2 * 64 * 64 * 32
    assert bwd.flops == 4 * gemm / 2  # dV, dP, dQ, dK (not flash: no recompute), causal
    assert bwd.bytes == 2 * (2 * 64 * 4 * 32 + 2 * 64 * 4 * 64 + 64 * 4 * 32) * 4
    assert backward_category("aten::_scaled_dot_product_efficient_attention") == "SDPA_bwd"
    x, wt = [8, 3, 32, 32], [16, 3, 3, 3]
    conv = backward_work("aten::convolution", json.dumps([x, wt, [], [], [], [], [], [], []]),
                         json.dumps([F32] * 2 + [""] * 7),
                         json.dumps(["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"]))
    assert conv.flops == 8 * 3 * 32 * 32 * 2 * (16 * 9) + 16 * 3 * 3 * 3 * 2 * (8 * 32 * 32)  # as its own backward
    assert not has_backward("aten::mm")  # TraceLens's GEMMs have none: MmBackward0 runs aten::mm, which has a model


def test_aiter_and_flash_attention_3_read_their_own_argument_positions():
    q = [2, 128, 8, 64]  # (batch, length, heads, head dim)
    full = 2 * 8 * 2 * 2 * 128 * 128 * 64  # QKᵀ and PV
    for name, first, causal_at in (("aiter::mha_fwd", 0, 5), ("aiter::fmha_v3_fwd", 0, 5),
                                   ("aiter::_flash_attn_forward", 0, 5), ("aiter::wrapper_fmha_v3_fwd", 1, 6),
                                   ("flash_attn_3::fwd", 0, 24)):
        dims = [[]] * first + [q] * 3  # aiter's wrapper_fmha_v3_fwd takes its output first
        concrete = [""] * (causal_at + 1)
        assert w(name, dims, [BF16] * len(dims), concrete).flops == full, name  # not causal unless it says so
        concrete[causal_at] = "True"
        fwd = w(name, dims, [BF16] * len(dims), concrete)
        assert (fwd.flops, fwd.bytes, category(name)) == (full / 2, 4 * 2 * 128 * 8 * 64 * 2, "SDPA_fwd"), name
    for name, causal_at in (("aiter::mha_bwd", 8), ("aiter::_flash_attn_backward", 12),
                            ("aiter::wrapper_fmha_v3_bwd", 9)):
        concrete = [""] * causal_at + ["True"]
        bwd = w(name, [q] * 4, [BF16] * 4, concrete)
        assert (bwd.flops, category(name)) == (5 * full / 2 / 2, "SDPA_bwd"), name  # 5 GEMMs of half of fwd's
