"""OnceLogger: what the library tells a user once per process is logged the first time only."""

import logging

from fp8train.log_once import OnceLogger

NAME = "fp8train.tests.log_once"


def _messages(caplog, name: str = NAME) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_a_message_is_logged_once_not_twice(caplog):
    log = OnceLogger(NAME)
    with caplog.at_level(logging.INFO, logger=NAME):
        log.info("fp8train: said once")
        log.info("fp8train: said once")
    assert _messages(caplog) == ["fp8train: said once"]
    assert caplog.records[0].levelno == logging.INFO


def test_distinct_messages_are_each_logged_once(caplog):
    log = OnceLogger(NAME)
    with caplog.at_level(logging.INFO, logger=NAME):
        for message in ("first", "second", "first", "second", "third"):
            log.info(message)
    assert _messages(caplog) == ["first", "second", "third"]


def test_each_logger_owns_what_it_said(caplog):
    # Two modules' loggers: one saying a message does not silence the other.
    first, second = OnceLogger(NAME), OnceLogger(NAME + ".other")
    with caplog.at_level(logging.INFO):
        first.info("the same words")
        second.info("the same words")
        second.info("the same words")
    assert _messages(caplog) == ["the same words"]
    assert _messages(caplog, NAME + ".other") == ["the same words"]


def test_a_message_with_percent_signs_is_logged_as_it_is(caplog):
    log = OnceLogger(NAME)
    with caplog.at_level(logging.INFO, logger=NAME):
        log.info("100% of %s")
    assert _messages(caplog) == ["100% of %s"]


def test_forget_logs_every_message_once_more(caplog):
    log = OnceLogger(NAME)
    with caplog.at_level(logging.INFO, logger=NAME):
        log.info("again")
        log.forget()
        log.info("again")
        log.info("again")
    assert _messages(caplog) == ["again", "again"]


def test_forget_runs_the_callbacks_registered_for_it():
    from fp8train.log_once import OnceLogger

    calls = []
    logger = OnceLogger("fp8train.test")
    logger.on_forget(lambda: calls.append(1))
    logger.forget()
    logger.forget()
    assert calls == [1, 1]
