"""Which attention kernel CUDA runs for each ``scaled_dot_product_attention`` call of chosen corpus entries, and why.

    python benchmarks/estimate/sdpa_choices.py c077_hf_seq2seq c083_hf_seq2seq --out $OUT     # GPU machine

For every call in one forward and backward of the entry's model (its corpus batch, its precision): the arguments'
shapes, dtypes, strides and ``requires_grad``, the backend ``torch._fused_sdp_choice`` picks, the reasons PyTorch
gives for refusing the flash, memory-efficient and cuDNN kernels (``can_use_*(..., debug=True)`` warnings), and
the aten ops the call ran with their output sizes. Writes ``sdpa_choices_<card>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "corpus"))


def _describe(t):  # noqa: ANN001, ANN202
    import torch

    if not isinstance(t, torch.Tensor):
        return repr(t)
    return {"shape": list(t.shape), "dtype": str(t.dtype), "stride": list(t.stride()), "grad": t.requires_grad}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ids", nargs="+")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.workload.loading import load_workload
    from memfit.workload.protocol import build

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[dict] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.ops.append({"op": str(func), "out": [_describe(o) for o in outs if isinstance(o, torch.Tensor)]})
            return out

    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "entries": {}}
    real_sdpa = F.scaled_dot_product_attention
    for entry in args.ids:
        calls: list[dict] = []

        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, calls=calls):  # noqa: ANN001, ANN202
            record = {"q": _describe(q), "k": _describe(k), "v": _describe(v), "mask": _describe(attn_mask),
                      "dropout_p": dropout_p, "is_causal": is_causal, "autocast": torch.is_autocast_enabled("cuda")}
            dq, dk, dv = q, k, v
            dm = attn_mask
            if torch.is_autocast_enabled("cuda"):
                dt = torch.get_autocast_dtype("cuda")
                dq, dk, dv = (x.to(dt) for x in (q, k, v))
                dm = attn_mask.to(dt) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
            try:
                record["choice"] = int(torch._fused_sdp_choice(dq, dk, dv, dm, dropout_p, is_causal, scale=scale,
                                                               enable_gqa=enable_gqa))
            except Exception as exc:  # noqa: BLE001
                record["choice"] = f"{type(exc).__name__}: {exc}"
            params = torch.backends.cuda.SDPAParams(dq, dk, dv, dm, dropout_p, is_causal, enable_gqa)
            for name, fn in (("flash", torch.backends.cuda.can_use_flash_attention),
                             ("efficient", torch.backends.cuda.can_use_efficient_attention),
                             ("cudnn", getattr(torch.backends.cuda, "can_use_cudnn_attention", None))):
                if fn is None:
                    continue
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ok = fn(params, True)
                record[name] = {"ok": bool(ok), "why": [str(w.message) for w in caught]}
            with Ops() as mode:
                out = real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                enable_gqa=enable_gqa)
            record["ops"] = mode.ops
            calls.append(record)
            return out

        F.scaled_dot_product_attention = sdpa
        torch.nn.functional.scaled_dot_product_attention = sdpa
        try:
            w = load_workload(f"{HERE.parent / 'corpus' / 'corpus.py'}:{entry}")
            w = w.replace(batch_size=max(1, w.batch_size // max(1, w.accumulation_steps)), accumulation_steps=1)
            model, optimizer, batch = build(w, "cuda")
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(w.precision)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                out = w.run_forward(model, batch)
                loss = w.loss(out, batch)
            loss.backward()
            results["entries"][entry] = {"calls": calls}
        except Exception as exc:  # noqa: BLE001
            results["entries"][entry] = {"calls": calls, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            F.scaled_dot_product_attention = real_sdpa
            torch.nn.functional.scaled_dot_product_attention = real_sdpa
    card = torch.cuda.get_device_name().split()[1].lower() if " " in torch.cuda.get_device_name() else "gpu"
    path = Path(args.out) / f"sdpa_choices_{card}.json"
    path.write_text(json.dumps(results, indent=1))
    print(path)


if __name__ == "__main__":
    main()
