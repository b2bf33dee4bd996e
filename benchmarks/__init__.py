"""ooojax benchmarks (`python -m benchmarks.<name>`); results in RESULTS.md."""

# Before any benchmark imports jax: on a host with the CUDA plugin and no GPU,
# start jax on CPU quietly (as `import ooojax` does), so compile-only GPU
# compiles work and no plugin error is printed.
from ooojax import _platform as _p

_p.default_to_cpu_without_gpu()
