import pytest
import torch


@pytest.fixture(autouse=True)
def no_registration_outlives_its_test(request):
    """After each GPU test: no page-locking failed (a range registered twice: a mapping dropped
    while registered), and a large allocation still works (a leaked registration whose
    addresses the driver reuses fails it with "resource already mapped")."""
    from flashckpt_integrations._utils import devices

    yield
    if not torch.cuda.is_available():
        return
    if request.node.get_closest_marker("plants_pin_failure") is None:  # (restored after this check)
        assert devices.pin_failure() is None, devices.pin_failure()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    probe = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del probe
    torch.cuda.empty_cache()
