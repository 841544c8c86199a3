"""grpc.aio's log of a send that core failed because the call had ended (issue 14.7)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from grpc._cython import cygrpc

from kvmesh.grpc_server import ENDED_CALL_FILTER, GRPC_AIO_LOGGER

MESSAGE = "ExecuteBatchError raised in core by servicer method [/kvmesh.v1.Worker/Decode]"


@pytest.fixture
def grpc_aio_log() -> Iterator[logging.Logger]:
    logger = logging.getLogger(GRPC_AIO_LOGGER)
    logger.addFilter(ENDED_CALL_FILTER)
    yield logger
    logger.removeFilter(ENDED_CALL_FILTER)


def log_failure(logger: logging.Logger, error: Exception) -> None:
    """As grpc.aio's server loop logs a handler's failure: at ERROR, with the traceback."""
    try:
        raise error
    except Exception:
        logger.exception(MESSAGE)


def test_a_send_core_failed_on_an_ended_call_is_one_debug_line(
    grpc_aio_log: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ended = cygrpc.ExecuteBatchError(
        'Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation>,)'
    )
    log_failure(grpc_aio_log, ended)
    assert [(r.levelno, r.exc_info) for r in caplog.records] == [(logging.DEBUG, None)]
    assert caplog.records[0].getMessage() == (
        f"{MESSAGE}: the call had ended (deadline or cancel) before it"
    )


@pytest.mark.parametrize(
    "error",
    [
        cygrpc.ExecuteBatchError("Failed grpc_call_start_batch: 8"),  # a misuse: two writes at once
        RuntimeError("a bug"),
    ],
    ids=["batch-never-started", "other"],
)
def test_every_other_failure_stays_an_error_with_its_traceback(
    grpc_aio_log: logging.Logger, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    log_failure(grpc_aio_log, error)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.exc_info[1] is error
