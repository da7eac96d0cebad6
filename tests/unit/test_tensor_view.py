"""The DLPack tensor boundary: every route agrees with torch's own metadata, and every rejection
path raises the documented exception naming the argument, the expected and the found value."""
import random

import pytest
import torch

from deepspeed_c import _C

FLAGS = _C.dtype_flags()
ANY = 0xFFFFFFFF
DEV_ANY, DEV_CPU, DEV_CUDA = 0, 1, 2
CONTIGUOUS, ALLOW_NONE, ALIGNED16 = 1, 2, 4
# torch >= 2.10 publishes the DLPack C exchange API and torch >= 2.9 takes __dlpack__(max_version=); an
# older torch (scripts/old_torch_tests.sh) has only the legacy __dlpack__(), which the auto route falls back
# to, and a route forced past what it has must fail with a clear error (test_routes_this_torch_lacks_refuse)
TORCH_MINOR = tuple(int(x) for x in torch.__version__.split(".")[:2])
HAS_EXCHANGE, HAS_VERSIONED = TORCH_MINOR >= (2, 10), TORCH_MINOR >= (2, 9)
ROUTES = {"auto": 0, **({"exchange": 1} if HAS_EXCHANGE else {}), **({"versioned": 2} if HAS_VERSIONED else {}),
          "legacy": 3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.bool, torch.int16]


def expected_view(t: torch.Tensor) -> dict:
    return {"data_ptr": t.data_ptr(), "dtype": str(t.dtype).removeprefix("torch."), "device": t.device.type,
            "shape": tuple(t.shape), "strides": tuple(t.stride()), "numel": t.numel(),
            "contiguous": t.is_contiguous(), "itemsize": t.element_size()}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_route_reports_torch_metadata(route, dtype):
    base = (torch.randn(6, 5) * 10).to(dtype)
    for t in (base, base[1:, 2:], base.t(), base[::2], torch.empty(0, dtype=dtype), base[3, 4]):
        got = _C.view_info(t, ROUTES[route])
        want = expected_view(t)
        for key, value in want.items():
            if key == "strides" and t.numel() == 0:
                continue
            assert got[key] == value, (route, key, got[key], value)


def test_exchange_api_is_present_on_this_torch():
    version = _C.exchange_api_version()
    assert (version is not None and version[0] == 1) if HAS_EXCHANGE else version is None


@pytest.mark.skipif(HAS_EXCHANGE, reason="this torch has every route (the older-torch CI leg runs this)")
def test_routes_this_torch_lacks_refuse():
    with pytest.raises(RuntimeError, match=r"no DLPack C exchange API \(needs torch >= 2.10\)"):
        _C.view_info(torch.randn(3), 1)
    if not HAS_VERSIONED:
        with pytest.raises(TypeError, match="max_version"):
            _C.view_info(torch.randn(3), 2)


def test_parameter_accepted_without_copy_on_every_route():
    p = torch.nn.Parameter(torch.randn(7, 3))
    for route in ROUTES.values():
        info = _C.view_info(p, route)
        assert info["data_ptr"] == p.data_ptr()
        assert info["shape"] == (7, 3)


def test_tensor_subclass_other_than_parameter_is_rejected():
    class MyTensor(torch.Tensor):
        pass

    t = torch.randn(3).as_subclass(MyTensor)
    with pytest.raises(TypeError, match="'x'.*subclass"):
        _C.check_view(t, "x", ANY, DEV_ANY, 0)


@pytest.mark.parametrize("bad", [None, 3, 2.5, "tensor", [1, 2], object(), torch.float32])
def test_non_tensor_rejected_naming_argument(bad):
    with pytest.raises(TypeError, match="'grads'"):
        _C.check_view(bad, "grads", ANY, DEV_ANY, 0)


def test_none_allowed_only_when_spec_says_so():
    assert _C.check_view(None, "opt", ANY, DEV_ANY, ALLOW_NONE) is None
    with pytest.raises(TypeError, match="'opt' must be a torch.Tensor, got None"):
        _C.check_view(None, "opt", ANY, DEV_ANY, 0)


def test_wrong_dtype_message_names_expected_and_found():
    t = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"argument 'params' must be float32 or bfloat16, got float16"):
        _C.check_view(t, "params", FLAGS["float32"] | FLAGS["bfloat16"], DEV_ANY, 0)


def test_complex_dtype_rejected():
    with pytest.raises(TypeError, match="'z'.*unsupported tensor dtype"):
        _C.check_view(torch.zeros(2, dtype=torch.complex64), "z", ANY, DEV_ANY, 0)


def test_wrong_device_message():
    with pytest.raises(ValueError, match=r"argument 'exp_avg' must be on the cuda device, got a cpu tensor"):
        _C.check_view(torch.zeros(3), "exp_avg", ANY, DEV_CUDA, 0)


def test_non_contiguous_rejected_when_required():
    t = torch.randn(4, 4).t()
    with pytest.raises(ValueError, match="'grad' must be contiguous"):
        _C.check_view(t, "grad", ANY, DEV_ANY, CONTIGUOUS)
    assert _C.check_view(t, "grad", ANY, DEV_ANY, 0)["contiguous"] is False
    # size-1 dims and empty tensors count as contiguous whatever their strides
    assert _C.check_view(torch.randn(4, 1)[:, :], "g", ANY, DEV_ANY, CONTIGUOUS)["contiguous"]
    assert _C.check_view(torch.randn(0, 3).t(), "g", ANY, DEV_ANY, CONTIGUOUS)["contiguous"]


def test_alignment_rejected_when_required():
    t = torch.zeros(64)
    assert _C.check_view(t, "buf", ANY, DEV_ANY, ALIGNED16)
    with pytest.raises(ValueError, match="'buf' must be 16-byte aligned"):
        _C.check_view(t[1:], "buf", ANY, DEV_ANY, ALIGNED16)


def test_list_items_are_named_by_index():
    good = [torch.zeros(2), torch.zeros(3)]
    assert _C.check_list(good, "params", FLAGS["float32"], DEV_CPU, CONTIGUOUS) == 2
    assert _C.check_list((), "params", FLAGS["float32"], DEV_CPU, CONTIGUOUS) == 0
    bad = [torch.zeros(2), torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(TypeError, match=r"'params\[1\]' must be float32, got float64"):
        _C.check_list(bad, "params", FLAGS["float32"], DEV_CPU, CONTIGUOUS)
    with pytest.raises(TypeError, match=r"'params\[0\]' must be a torch.Tensor"):
        _C.check_list([1.0], "params", ANY, DEV_ANY, 0)
    with pytest.raises(TypeError, match="'params' must be a list or tuple"):
        _C.check_list(torch.zeros(3), "params", ANY, DEV_ANY, 0)
    with pytest.raises(TypeError, match="'params' must be a list or tuple"):
        _C.check_list(iter(good), "params", ANY, DEV_ANY, 0)


def test_list_agreement_and_aliasing():
    a = [torch.zeros(2), torch.zeros(5)]
    _C.check_lists(a, [torch.ones(2), torch.ones(5)])
    with pytest.raises(ValueError, match="'a' and 'b' must have the same length, got 2 and 1"):
        _C.check_lists(a, [torch.ones(2)])
    with pytest.raises(ValueError, match=r"'a\[1\]' has 5 elements but 'b\[1\]' has 4"):
        _C.check_lists(a, [torch.ones(2), torch.ones(4)])
    buf = torch.zeros(10)
    _C.check_pair(buf[:5], buf[5:])
    with pytest.raises(ValueError, match="'out' overlaps input argument 'inp'"):
        _C.check_pair(buf[2:7], buf[:5])
    with pytest.raises(ValueError, match="same number of elements, got 4 and 5"):
        _C.check_pair(buf[:4], buf[5:])


def test_bad_fastcall_arity_is_a_type_error():
    with pytest.raises(TypeError, match="check_view\\(\\) takes exactly 5 arguments \\(1 given\\)"):
        _C.check_view(torch.zeros(1))
    with pytest.raises(TypeError):
        _C.view_info()
    with pytest.raises(ValueError, match="route must be 0..3"):
        _C.view_info(torch.zeros(1), 9)


def test_random_wrong_arguments_never_crash():
    rng = random.Random(1234)
    pool = [None, 0, -1, 2**70, 1.5, "x", b"y", [], [None], [torch.zeros(1), "a"], (torch.zeros(2),),
            torch.zeros(3), torch.zeros(3, dtype=torch.complex64), torch.zeros(2, 2).t(), {}, object(),
            torch.nn.Parameter(torch.zeros(2)), torch.zeros(0), torch.zeros(1, dtype=torch.bool)]
    funcs = [(_C.check_view, 5), (_C.check_list, 5), (_C.check_pair, 2), (_C.check_lists, 2),
             (_C.view_info, 2), (_C.current_cuda_stream, 1)]
    for _ in range(3000):
        fn, arity = rng.choice(funcs)
        args = [rng.choice(pool) for _ in range(rng.choice([arity, arity, rng.randint(0, 6)]))]
        try:
            fn(*args)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_views_and_current_stream():
    t = torch.randn(8, device="cuda")
    for route in ROUTES.values():
        assert _C.view_info(t, route)["device"] == "cuda"
    with pytest.raises(ValueError, match="must be on the cpu device"):
        _C.check_view(t, "x", ANY, DEV_CPU, 0)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        _C.check_list([torch.zeros(1), t], "xs", ANY, DEV_ANY, 0)
    s = torch.cuda.Stream()
    assert _C.current_cuda_stream(0) == torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(s):
        assert _C.current_cuda_stream(0) == s.cuda_stream
