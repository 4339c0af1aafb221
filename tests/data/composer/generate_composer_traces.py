"""Write real Composer traces: composer's Trainer with its Profiler, JSONTraceHandler and the torch profiler, on
one CPU rank of a gloo job (run one process per rank; README.md beside this file says how).

torchvision is stubbed: composer imports it at start-up, a trace needs none of it, and the PyPI wheel does not
load beside the local CPU wheel of torch 2.13.0.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _NoTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``torchvision`` module an empty one whose names are empty classes."""

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attribute(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

        module.__getattr__ = attribute
        return module

    def exec_module(self, module) -> None:
        pass


def main(out: str) -> None:
    import torch
    from composer import Trainer
    from composer.models import ComposerClassifier
    from composer.profiler import JSONTraceHandler, Profiler, cyclic_schedule
    from composer.utils import dist
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    data = TensorDataset(torch.randn(512, 64), torch.randint(0, 8, (512,)))
    loader = DataLoader(data, batch_size=16, sampler=dist.get_sampler(data, shuffle=False))
    profiler = Profiler(
        trace_handlers=[JSONTraceHandler(folder=out, merged_trace_filename=None, remote_file_name=None,
                                         overwrite=True)],
        schedule=cyclic_schedule(skip_first=1, wait=0, warmup=1, active=3, repeat=1),
        torch_prof_record_shapes=True, torch_prof_with_stack=False)
    trainer = Trainer(model=ComposerClassifier(net, num_classes=8), train_dataloader=loader, max_duration="8ba",
                      device="cpu", profiler=profiler, progress_bar=False, log_to_console=False)
    trainer.fit()
    trainer.close()


if __name__ == "__main__":
    sys.meta_path.insert(0, _NoTorchvision())
    main(sys.argv[1])
