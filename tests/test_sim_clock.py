"""The simulator's virtual-time asyncio loop: sleeps, timeouts and deadlocks follow virtual time (issue 8)."""

import asyncio
import random
import socket
import time

import pytest

from tiderl_jax.sim import clock
from tiderl_jax.sim.clock import VirtualTimeDeadlock

HOUR = 3600.0


def test_parallel_sleeps_finish_in_virtual_order_and_take_the_longest():
    finished = []

    async def sleeper(name, hours):
        await asyncio.sleep(hours * HOUR)
        finished.append((name, clock.now()))

    async def main():
        t0 = clock.now()
        await asyncio.gather(sleeper("c", 3), sleeper("a", 1), sleeper("b", 2))
        return clock.now() - t0

    wall = time.perf_counter()
    elapsed = clock.run(main())
    wall = time.perf_counter() - wall
    assert finished == [("a", HOUR), ("b", 2 * HOUR), ("c", 3 * HOUR)]
    assert elapsed == 3 * HOUR  # the max of the parallel sleeps, not their sum
    assert wall < 30.0  # three hours of virtual time; a real loop would take 10800 s (generous bound)


def test_sleeps_longer_than_the_selectors_maximum_timeout():
    async def main():
        await asyncio.sleep(10 * 24 * HOUR)  # asyncio caps one select at 24 h: ten jumps
        return clock.now()
    assert clock.run(main(), start=5.0) == pytest.approx(5.0 + 10 * 24 * HOUR)


def test_timeouts_run_on_virtual_time():
    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), timeout=3)
        t_wait_for = clock.now()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2):
                await asyncio.sleep(100)
        return t_wait_for, clock.now()
    assert clock.run(main()) == (3.0, 5.0)


def test_call_later_and_sequential_sleeps_accumulate():
    async def main():
        loop = asyncio.get_running_loop()
        fired = loop.create_future()
        loop.call_later(7.5, lambda: fired.set_result(loop.time()))
        await asyncio.sleep(2)
        await asyncio.sleep(3)
        return clock.now(), await fired, clock.now()
    assert clock.run(main()) == (5.0, 7.5, 7.5)


def test_a_task_waiting_forever_is_a_named_deadlock():
    async def stuck():
        await asyncio.sleep(5)
        await asyncio.get_running_loop().create_future()  # nobody will ever set it

    async def main():
        await asyncio.create_task(stuck(), name="stuck-worker")

    with pytest.raises(VirtualTimeDeadlock, match=r"deadlock at t=5\.0+s.*stuck-worker"):
        clock.run(main())


def test_blocking_on_real_io_with_no_timers_is_a_deadlock_not_a_hang():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        async def ready_data():
            b.send(b"x")  # already in the kernel when the loop polls: seen, no time passes
            return await asyncio.get_running_loop().sock_recv(a, 1), clock.now()
        assert clock.run(ready_data()) == (b"x", 0.0)

        async def never():
            return await asyncio.get_running_loop().sock_recv(a, 1)  # no writer, no timer
        with pytest.raises(VirtualTimeDeadlock, match="no timer is scheduled"):
            clock.run(never())
    finally:
        a.close()
        b.close()


def test_executor_jobs_take_no_virtual_time_and_are_not_overtaken():
    order = []

    async def timer():
        await asyncio.sleep(5)
        order.append(("timer", clock.now()))

    async def thread_job():
        await asyncio.to_thread(time.sleep, 0.05)  # real work in a thread
        order.append(("thread", clock.now()))

    async def main():
        await asyncio.gather(timer(), thread_job())
    clock.run(main())
    assert order == [("thread", 0.0), ("timer", 5.0)]


def test_runs_are_deterministic():
    def trace(seed):
        rng, log = random.Random(seed), []

        async def task(i):
            for turn in range(3):
                await asyncio.sleep(rng.lognormvariate(0.0, 1.0))
                log.append((i, turn, clock.now()))

        async def main():
            await asyncio.gather(*(task(i) for i in range(4)))
        clock.run(main())
        return log
    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


def test_the_clock_never_runs_backwards():
    loop = clock.new_event_loop(start=1.0)
    try:
        loop.advance(2.0)
        assert loop.time() == 3.0
        with pytest.raises(ValueError, match="seconds=-1"):
            loop.advance(-1)
    finally:
        loop.close()
