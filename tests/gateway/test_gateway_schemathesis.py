"""Schemathesis against the gateway's OpenAPI schema: generated valid and invalid requests to every route of a
real gateway (in front of the scripted engine, recording to the real Kafka) never get a 5xx.

Every generated request that names a session is sent to a freshly opened one, so bodies reach the route's logic
instead of stopping at 404; unknown and unsafe session ids are covered in test_gateway_limits.
"""

import schemathesis
from schemathesis.checks import not_a_server_error

from forge_stream.events import new_event_id
from forge_stream.gateway.app import create_app
from forge_stream.gateway.settings import GatewaySettings

from gateway_support import open_session

EXAMPLES = 8  # per route and generation mode: keeps the whole test well under a minute
GROUP = f"schemathesis-{new_event_id()}"


# The OpenAPI document does not depend on the settings, so it is read from an app that is never served; the
# requests go to the real gateway of the `gateway_url` fixture. (schemathesis.pytest.from_fixture would load it
# from there, but its lazy loader does not run under pytest 9.)
schema = schemathesis.openapi.from_dict(
    create_app(GatewaySettings(engines=("http://127.0.0.1:9",), bootstrap="127.0.0.1:9")).openapi())
schema.config.generation.update(max_examples=EXAMPLES, deterministic=True, no_shrink=True)
schema.config.phases.coverage.enabled = False  # its hundreds of boundary cases per route take minutes here


@schema.parametrize()
def test_no_server_errors(case, gateway_url):
    if "session_id" in (case.path_parameters or {}):
        case.path_parameters["session_id"] = open_session(gateway_url, GROUP)["session_id"]
    case.call_and_validate(base_url=gateway_url, checks=[not_a_server_error])
