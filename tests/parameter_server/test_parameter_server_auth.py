"""Tier 3: ParameterServerStrategy authenticates its servers: a fresh secret, or the hand-started servers' secret file."""

import pytest
import torch
from _helpers import TinyRegression, fit

from lightning_pdist import ParameterServerStrategy
from lightning_pdist.core.ps_auth import read_secret_file
from lightning_pdist.core.ps_client import ServerConnection, ServerError
from lightning_pdist.parameter_server.process import start_server
from lightning_pdist.core.ps_wire import Kind


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef" * 4 + "\n")
    path.chmod(0o600)
    return str(path)


def test_hand_started_servers_with_a_secret_file_train_like_the_strategys_own(secret_file):
    """Two servers started with the file's secret + server_secret_file: the same weights as strategy-started servers."""
    own, hand = TinyRegression(), TinyRegression()
    fit(ParameterServerStrategy(num_servers=2, start_method="fork"), own, max_steps=6)
    servers = [start_server(i, secret=read_secret_file(secret_file)) for i in range(2)]
    try:
        stranger = ServerConnection(0, servers[0].address, timeout=10)
        with pytest.raises(ServerError, match="requires authentication"):  # they take no worker without the secret
            stranger.request(Kind.GET_STATE, {})
        stranger.close()
        strategy = ParameterServerStrategy(server_addresses=[s.address for s in servers], server_secret_file=secret_file,
                                           start_method="fork")  # fmt: skip
        fit(strategy, hand, max_steps=6)
    finally:
        for server in servers:
            server.stop(timeout=10)
    torch.testing.assert_close(flat(hand), flat(own), atol=1e-6, rtol=0)


def test_server_secret_file_is_refused_without_addresses_or_when_missing_or_open(secret_file, tmp_path):
    """server_secret_file: refused with argument, value and rule without server_addresses, missing, or group-readable."""
    with pytest.raises(ValueError, match=r"ParameterServerStrategy\(server_secret_file='.*secret'\): server_secret_file "
                                         r"authenticates servers started by hand and needs server_addresses"):  # fmt: skip
        ParameterServerStrategy(server_secret_file=secret_file)
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"server_secret_file='.*missing'\): no such file; the secret file must exist"):
        ParameterServerStrategy(server_addresses=["127.0.0.1:5000"], server_secret_file=missing)
    (tmp_path / "secret").chmod(0o604)
    with pytest.raises(ValueError, match=r"server_secret_file='.*secret'\): mode 0o604 lets group or others access it; "
                                         r"the secret file must be readable only by its owner"):  # fmt: skip
        ParameterServerStrategy(server_addresses=["127.0.0.1:5000"], server_secret_file=secret_file)
    with pytest.raises(TypeError, match=r"server_secret_file=3\): server_secret_file must be a path string"):
        ParameterServerStrategy(server_addresses=["127.0.0.1:5000"], server_secret_file=3)


def test_hand_started_servers_without_a_secret_warn_that_they_are_unauthenticated(secret_file):
    """server_addresses without server_secret_file is legal but warns; with it, no warning."""
    with pytest.warns(UserWarning, match=r"server_secret_file=None\): these servers are unauthenticated"):
        ParameterServerStrategy(server_addresses=["127.0.0.1:5000"])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParameterServerStrategy(server_addresses=["127.0.0.1:5000"], server_secret_file=secret_file)
