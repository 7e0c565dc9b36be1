"""Run `layerprune recover` as one process of a CPU FSDP2 group (gloo), for tests: `torchrun ... fsdp_cpu.py ARGS`,
or several recoveries one after the other in the same group: `$RECOVER_RUNS`, a JSON list of {"args", "gathered"}
(one start of the group and its interpreters for all of them).

accelerate turns FSDP on only for accelerator devices; on a CPU it would quietly run plain data parallel. This
launcher lets its FSDP plugin apply to the gloo group too (FSDP2 itself runs on CPUs), and records the weights
gathered from every rank when training ends (to $GATHERED) so a test can compare the saved model with them.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from transformers import TrainerCallback

_init = AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):  # type: ignore[no-untyped-def]
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState() copies it back


class RecordGathered(TrainerCallback):
    """At the end of training every rank joins the gather; rank 0 saves the full state dict."""

    def on_train_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        assert any(isinstance(m, FSDPModule) for m in model.modules()), "the model was not sharded with FSDP2"
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if torch.distributed.get_rank() == 0:
            torch.save({k: v.clone() for k, v in full.items()}, os.environ["GATHERED"])


def _recorded(make):  # type: ignore[no-untyped-def]
    def make_recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        trainer = make(*args, **kwargs)
        trainer.add_callback(RecordGathered())
        return trainer

    return make_recorded


def main() -> int:
    from layerprune.cli import main as cli_main
    from layerprune.recover import train
    from layerprune.recover.methods import distill

    AcceleratorState.__init__ = _fsdp_on_cpu
    for module in (train, distill):  # SFT's trainer and the distillation family's (kd, opd, replace)
        module.make_trainer = _recorded(module.make_trainer)
    runs = json.loads(os.environ.get("RECOVER_RUNS") or "null") or [{"args": sys.argv[1:],
                                                                       "gathered": os.environ["GATHERED"]}]
    for run in runs:
        os.environ["GATHERED"] = run["gathered"]
        code = cli_main(["recover", *run["args"]])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
