"""The local broker formats and starts whatever random cluster id it draws (one starting with "-" included)."""

import base64

from forge_stream.kafka import broker
from forge_stream.settings import ForgeSettings


def test_cluster_id_starting_with_a_dash_formats(tmp_path, monkeypatch):
    real = base64.urlsafe_b64encode
    monkeypatch.setattr(broker.base64, "urlsafe_b64encode", lambda raw: b"-" + real(raw)[1:])
    local = broker.LocalBroker(broker.BrokerConfig(tmp_path, ForgeSettings().cache_dir, port=broker.free_port(),
                                                   controller_port=broker.free_port()))
    try:
        local.start()
    finally:
        local.stop()
    assert "cluster.id=-" in (tmp_path / "data" / "meta.properties").read_text()
