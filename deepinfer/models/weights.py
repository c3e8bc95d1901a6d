"""Loading checkpoint tensors into a model whose own layout fuses some of them (q/k/v into qkv_proj,
gate/up into gate_up_proj), and writing them back under the checkpoint's names.

Mixed into a model class that sets ``FUSED`` (fused param, checkpoint part, shard index) and implements
``_fused_splits(fused) -> [rows of each shard]``. Submodules that load their own tensors (MoE blocks)
are delegates: they implement ``load_checkpoint_tensor(local_name, tensor, full_name)``,
``missing_checkpoint_tensors()`` and ``checkpoint_tensors()``, and may set ``checkpoint_prefix``.
"""

from __future__ import annotations

from typing import Iterable

from .base import WeightError


class FusedCheckpoint:
    FUSED: tuple = ()

    def _fused_splits(self, fused: str) -> list:
        raise NotImplementedError

    def _target(self, name: str):
        """Checkpoint name -> (our param name, shard index or None)."""
        for fused, part, idx in self.FUSED:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), idx
        return name, None

    def _delegates(self) -> dict:
        """checkpoint prefix -> (module, our param prefix) of the submodules that load their own tensors."""
        out = {}
        for pname, mod in self.named_modules():
            if hasattr(mod, "load_checkpoint_tensor"):
                out[getattr(mod, "checkpoint_prefix", None) or pname] = (mod, pname)
        return out

    def load_weights(self, weights: Iterable) -> None:
        delegates = self._delegates()
        owned = tuple(p + "." for _, p in delegates.values())
        params = {n: p for n, p in self.named_parameters() if not n.startswith(owned)}
        fused_names = {f for f, _, _ in self.FUSED}
        seen: set = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue  # buffers some checkpoints carry; we compute them
            head = name.rsplit(".", 1)[0]
            while head and head not in delegates:
                head = head.rsplit(".", 1)[0] if "." in head else ""
            if head:
                delegates[head][0].load_checkpoint_tensor(name[len(head) + 1:], tensor, full_name=name)
                continue
            target, idx = self._target(name)
            if target not in params:
                if name.startswith("lm_head.") and self.lm_head is None:
                    continue  # tied checkpoint that still stores the head
                raise WeightError(f"checkpoint tensor {name!r} does not belong to {self.arch} "
                                  f"(config: {self.config.num_layers} layers{_dense_hint(self, name)})")
            p = params[target]
            if idx is None:
                dst = p.data
            else:
                splits = self._fused_splits(target.split(".")[-2])
                dst = p.data.narrow(0, sum(splits[:idx]), splits[idx])
            if tuple(tensor.shape) != tuple(dst.shape):
                raise WeightError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype))
            seen.add((target, idx))
        missing = []
        for pname in params:
            fused = pname.split(".")[-2] if pname.endswith((".weight", ".bias")) else ""
            if fused in fused_names:
                missing += [pname.replace(f".{fused}.", f".{part}.") for f, part, idx in self.FUSED
                            if f == fused and (pname, idx) not in seen]
            elif (pname, None) not in seen:
                missing.append(pname)
        for prefix, (mod, _) in delegates.items():
            missing += [f"{prefix}.{n}" for n in mod.missing_checkpoint_tensors()]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise WeightError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more} needed by {self.arch}")

    def hf_state_dict(self) -> dict:
        out = {}
        delegates = self._delegates()
        owned = tuple(p + "." for _, p in delegates.values())
        for prefix, (mod, _) in delegates.items():
            out.update({f"{prefix}.{n}": t for n, t in mod.checkpoint_tensors().items()})
        fused_names = {f for f, _, _ in self.FUSED}
        for pname, p in self.named_parameters():
            if pname.startswith(owned):
                continue
            fused = pname.split(".")[-2]
            if fused in fused_names:
                parts = [part for f, part, _ in self.FUSED if f == fused]
                for part, t in zip(parts, p.data.split(self._fused_splits(fused), dim=0)):
                    out[pname.replace(f".{fused}.", f".{part}.")] = t.contiguous()
            else:
                out[pname] = p.data.contiguous()
        return out


def _dense_hint(model, name: str) -> str:
    """Where an expert tensor names a layer the config makes dense: say which layers are MoE (a checkpoint written
    under another rule, e.g. transformers ignoring DeepSeek's moe_layer_freq)."""
    parts = name.split(".")
    moe = getattr(model, "moe_layers", None)
    if moe is None or len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() \
            or not any(k in parts[4] for k in ("expert", "gate")):
        return ""
    layer = int(parts[2])
    return "" if layer in moe else f"; layer {layer} is dense under it, the MoE layers are {list(moe)}"
