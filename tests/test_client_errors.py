"""The client sorts server errors by the code the server put on them, never by their wording."""

from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

from nexus_sli.client import (
    EncoderClient,
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    NoModelError,
    ServerUnavailableError,
)
from nexus_sli.client import error_codes
from nexus_sli.client.protocol import translate


def server_error(message: str, status: str = "StatusCode.INTERNAL") -> InferenceServerException:
    return InferenceServerException(msg=message, status=status)


@pytest.mark.parametrize("code, kind", [(error_codes.INVALID_INPUT, InvalidInputError),
                                        (error_codes.INFERENCE_FAILED, InferenceError)])
def test_each_code_maps_to_one_error_type_however_the_message_reads(code, kind):
    for wording in ("TEXT item 0 is not valid UTF-8", "a message reworded entirely", ""):
        # Triton's ensemble puts its own words in front of a step's message
        error = translate(server_error(f"in ensemble 'm', {error_codes.mark(code, wording)}"), "m")
        assert type(error) is kind


def test_every_code_has_a_client_error_type():
    for code in error_codes.CODES:
        assert isinstance(translate(server_error(error_codes.mark(code, "x")), "m"), (InvalidInputError, InferenceError))


def test_unmarked_messages_never_become_invalid_input_by_their_words():
    error = translate(server_error("TEXT item 0 is not valid UTF-8; text is empty; is too long"), "m")
    assert type(error) is InferenceError


def test_tritons_own_errors_are_sorted_by_transport_status():
    assert type(translate(server_error("whatever", "StatusCode.NOT_FOUND"), "m")) is ModelNotFoundError
    assert type(translate(server_error("whatever", "404"), "m")) is ModelNotFoundError
    assert type(translate(server_error("whatever", "StatusCode.INVALID_ARGUMENT"), "m")) is InvalidInputError
    assert type(translate(server_error("whatever", "400"), "m")) is InvalidInputError
    assert type(translate(server_error("whatever", "StatusCode.UNAVAILABLE"), "m")) is ServerUnavailableError
    assert type(translate(ConnectionRefusedError(111, "Connection refused"), "m")) is ServerUnavailableError
    # a server that hangs past the client's deadline is treated as one that is down: retryable
    for slow in (server_error("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED"), TimeoutError()):
        error = translate(slow, "m")
        assert type(error) is ServerUnavailableError and "did not answer within" in str(error)


def test_marking_refuses_unknown_codes_and_finds_none_in_plain_text():
    with pytest.raises(ValueError, match="unknown error code"):
        error_codes.mark("oops", "x")
    assert error_codes.code_of("[nexus:oops] x") is None and error_codes.code_of("plain") is None


def test_a_call_without_a_model_needs_the_clients_default():
    with EncoderClient("127.0.0.1:1") as client:  # nothing is sent before the model is known
        with pytest.raises(NoModelError, match="pass model=..."):
            client.embed("a text")
    assert EncoderClient("127.0.0.1:1", model="m").model == "m"
