"""agentopd.aio.gather_or_cancel: the first error propagates, and no other episode's end is left for asyncio.run's
shutdown to print. An episode whose env call was still running in a thread when another failed ended with its own
error while asyncio.run cancelled it, and asyncio printed that traceback ("unhandled exception during asyncio.run()
shutdown") under the run's one-line error (test_plugin_env's reset case, once under pytest -n 2)."""

import asyncio

import pytest

from agentopd.aio import gather_or_cancel


async def _fails(tag: str, delay: float):
    await asyncio.sleep(delay)
    raise ValueError(tag)


async def _fails_when_cancelled():  # an env call in a thread: cancelling its await still ends with the env's error
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise ValueError("second") from None


def test_the_first_error_propagates_and_nothing_is_left_for_shutdown():
    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        await gather_or_cancel([_fails("first", 0.01), _fails_when_cancelled()])

    with pytest.raises(ValueError, match="first"):
        asyncio.run(main())
    assert reported == [], reported


def test_results_come_back_in_order():
    async def value(v: int, delay: float):
        await asyncio.sleep(delay)
        return v

    assert asyncio.run(gather_or_cancel([value(1, 0.02), value(2, 0.0), value(3, 0.01)])) == [1, 2, 3]
