"""What each GPU generation gets, checked on the CPU by faking the compute capability
(MINILLM_FAKE_CAPABILITY): float16 where bfloat16 is missing (T4), no fp8 KV in the Triton kernels
below sm_89, fp8 weights dequantized below sm_90 — each said in words."""

from types import SimpleNamespace

import pytest
import torch

from kernel_utils import DEVICE  # noqa: F401  first: picks the interpreter before triton is imported

from minillm import hardware
from minillm.hardware import GPU_FEATURES, capability_tuple, describe_gpu_formats, gpu_formats, resolve_dtype

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


@pytest.fixture
def fake_card(monkeypatch):
    def fake(capability: str):
        monkeypatch.setenv("MINILLM_FAKE_CAPABILITY", capability)
    return fake


@pytest.mark.parametrize("capability,dtypes,kv_dtypes,fp8_weights,cannot", [
    (75, ("float32", "float16"), ("int8",), "dequantize", ("bf16", "fp8", "fp8_matmul")),
    (80, ("float32", "float16", "bfloat16"), ("int8",), "dequantize", ("fp8", "fp8_matmul")),
    (86, ("float32", "float16", "bfloat16"), ("int8",), "dequantize", ("fp8", "fp8_matmul")),
    (89, ("float32", "float16", "bfloat16"), ("int8", "fp8"), "dequantize", ("fp8_matmul",)),
    (90, ("float32", "float16", "bfloat16"), ("int8", "fp8"), "triton", ()),
])
def test_formats_of_each_target(capability, dtypes, kv_dtypes, fp8_weights, cannot):
    formats = gpu_formats(capability)
    assert formats["dtypes"] == dtypes and formats["kv_dtypes"] == kv_dtypes and formats["fp8_weights"] == fp8_weights
    assert formats["auto_dtype"] == ("bfloat16" if "bfloat16" in dtypes else "float16")
    assert formats["cannot"] == [GPU_FEATURES[f][1] for f in cannot]
    line = describe_gpu_formats(capability)
    assert line.startswith(f"sm_{capability} (") and all(GPU_FEATURES[f][1] in line for f in cannot)


@pytest.mark.parametrize("capability,want", [("7.5", torch.float16), ("8.0", torch.bfloat16), ("9.0", torch.bfloat16)])
def test_auto_dtype_per_card(fake_card, capability, want, recwarn):
    fake_card(capability)
    assert resolve_dtype("auto", CUDA) is want
    said = [str(w.message) for w in recwarn if "bfloat16" in str(w.message)]
    assert bool(said) == (want is torch.float16), said
    if said:
        assert said[0].startswith("sm_75: bfloat16 needs sm_80+") and "float16" in said[0]


def test_bfloat16_on_a_t4_is_refused_with_the_alternative(fake_card):
    fake_card("7.5")
    with pytest.raises(ValueError, match=r"dtype='bfloat16' .*sm_75.*Use dtype='float16'"):
        resolve_dtype("bfloat16", CUDA)
    assert resolve_dtype("float16", CUDA) is torch.float16
    assert resolve_dtype("float32", CUDA) is torch.float32


def test_cpu_dtypes_ignore_the_fake_card(fake_card):
    fake_card("7.5")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


@pytest.mark.parametrize("capability,refused", [("8.0", True), ("8.6", True), ("8.9", False), ("9.0", False)])
def test_fp8_kv_cache_in_the_triton_kernels_needs_sm89(fake_card, capability, refused):
    from minillm.engine.model_runner import ModelRunner

    fake_card(capability)
    build = lambda: ModelRunner(SimpleNamespace(), CUDA, None,  # noqa: E731
                                kv_cache=SimpleNamespace(kv_dtype="fp8"), attention_backend="triton")
    if refused:
        with pytest.raises(ValueError, match=rf"kv_dtype='fp8' .* sm_{capability.replace('.', '')}: fp8 e4m3 needs "
                                             r"sm_89\+.*kv_dtype='int8'"):
            build()
    else:
        assert build().backend.name == "triton"


@pytest.mark.parametrize("capability,on_kernels", [("8.9", False), ("9.0", True), ("10.0", True)])
def test_fp8_weight_kernels_run_on_sm90_and_newer(fake_card, capability, on_kernels):
    from minillm.kernels.channel_matmul import fp8_supported

    fake_card(capability)
    assert fp8_supported(CUDA) is on_kernels


@pytest.mark.parametrize("given,want", [(75, (7, 5)), ("sm_86", (8, 6)), ("9.0", (9, 0)), ((8, 9), (8, 9)), ("10.0", (10, 0))])
def test_capability_spellings(given, want):
    assert capability_tuple(given) == want


def test_bad_capability_and_feature_names():
    with pytest.raises(ValueError, match="capability='ampere'"):
        capability_tuple("ampere")
    with pytest.raises(ValueError, match="feature='fp4' is not one of"):
        hardware.missing_gpu_feature(90, "fp4")
