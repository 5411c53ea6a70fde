"""A staging aid for SGLang 0.5.17 on the lent H200 machines only, never imported by megarl: benchmarks/h200/stage.sh
copies it into /tmp/site (copied here from ../shared/tools/sglang-h200/). It lets SGLang's config registry coexist
with that image's transformers 5.17 and stands in for packages SGLang lists but this path never calls."""

import importlib.abc
import importlib.machinery
import sys
import types

try:
    import transformers.models.auto.configuration_auto as _ca

    _orig = _ca._LazyConfigMapping.register
    _ca._LazyConfigMapping.register = lambda self, k, v, exist_ok=False: _orig(self, k, v, exist_ok=True)
except Exception as e:
    print("sitecustomize:", e)

STUB = {"IPython", "flash_attn_4", "quack", "tilelang", "helion", "tokenspeed_mla", "deep_gemm", "humming",
        "humming_kernels", "nvidia_mathdx"}


class _Any:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Any()

    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _Any()


def _modattr(n):
    if n.startswith("__"):
        raise AttributeError(n)
    return _Any()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUB:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__file__ = __file__
        m.__getattr__ = _modattr
        return m

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
