import torch

from memfit.estimate.cuda_emulation import CudaSemantics, cpu_only_autocast_ops, cuda_autocast_policy


def test_policy_is_read_from_the_installed_torch_and_covers_the_usual_ops():
    policy = cuda_autocast_policy()
    assert policy["mm"] == policy["conv2d"] == policy["linear"] == "lower_precision_fp"
    assert policy["layer_norm"] == policy["mse_loss"] == policy["upsample_nearest2d"] == "fp32"
    assert policy["softmax.int"] == policy["log_softmax.int"] == "fp32_set_opt_dtype"
    assert policy["addcmul"] == "promote"


def test_every_policy_op_exists_and_has_a_cuda_autocast_kernel():
    from memfit import _torch_private as tp

    missing = [n for n in cuda_autocast_policy() if not tp.has_kernel(f"aten::{n}", "AutocastCUDA")]
    assert missing == []


def test_cpu_only_autocast_ops_are_not_cast():
    names = cpu_only_autocast_ops(tuple(cuda_autocast_policy()))
    assert "max_pool3d" in names and "mm" not in names
    with CudaSemantics(), torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(1, 1, 4, 4, 4, dtype=torch.bfloat16)
        assert torch.nn.functional.max_pool3d(x, 2).dtype == torch.bfloat16  # CPU autocast would give fp32


def test_cuda_policy_inside_autocast():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with CudaSemantics(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
        assert y.dtype == torch.bfloat16
        assert torch.nn.functional.layer_norm(y, (8,)).dtype == torch.float32
        assert y.softmax(-1).dtype == torch.float32
        assert torch.nn.functional.interpolate(y[None], scale_factor=2.0).dtype == torch.float32


def test_everything_is_undone_on_exit():
    x = torch.randn(16, requires_grad=True)
    with CudaSemantics():
        inside = torch.nn.functional.dropout(x, 0.5).grad_fn
    outside = torch.nn.functional.dropout(x, 0.5).grad_fn
    assert type(inside).__name__ == "NativeDropoutBackward0"
    assert type(outside).__name__ != "NativeDropoutBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.layer_norm(torch.randn(2, 8), (8,)).dtype == torch.float32
