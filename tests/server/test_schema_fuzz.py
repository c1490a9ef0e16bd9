"""Schema-driven fuzzing (schemathesis) over the server's own OpenAPI document: valid
and invalid requests for every operation. No 5xx, and every 4xx in OpenAI's error
shape. The suite's run is bounded (derandomized, a few dozen examples an operation);
``-m slow`` runs a longer, random one."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server.helpers import ServerThread

_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def fuzz_server(model_path):
    # Tight limits keep the valid requests schemathesis finds small.
    with ServerThread(model_path, max_tokens_limit=4, max_n=2, max_prompts=2,
                      max_num_queued_tokens=2000, max_request_body_bytes=65536) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_dict(fuzz_server.app.openapi())


def check(case, server) -> None:
    r = case.call(base_url=server.base_url, timeout=60)
    assert r.status_code < 500, (case.as_curl_command(), r.text)
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"}, r.text
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
        assert isinstance(err["message"], str) and err["message"] and err["type"], r.text


def fuzz(schema, server, mode: GenerationMode, **extra) -> None:
    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(**_SETTINGS, **extra)
    def run(case) -> None:
        check(case, server)

    run()


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_openapi_fuzz(api_schema, fuzz_server, mode):
    fuzz(api_schema, fuzz_server, mode, max_examples=50, derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_openapi_fuzz_long(api_schema, fuzz_server, mode):
    fuzz(api_schema, fuzz_server, mode, max_examples=2000)
