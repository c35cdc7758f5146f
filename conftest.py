"""Repository-wide pytest settings."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models run on one thread: on a loaded 2-core machine, OpenMP spin-waiting between two threads
    made tiny-model tests ~20x slower. Real-model tests keep the machine's thread count."""
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("real_model") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
