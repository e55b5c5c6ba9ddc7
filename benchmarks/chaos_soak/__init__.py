"""Chaos soak: every role of a fleet SIGKILLed in turn under a mixed open-loop load, and every
answer checked.

    python -m benchmarks.chaos_soak [--model DIR] [--duration-s 600]
        [--capacity-fraction 0.7 | --rate R] [--victims ...]

The fleet (fleet.py): a store master and two data nodes (each block on both), 2 prefill and
2 decode workers, 2 routers, each its own `pdserve <role>` process on loopback, with a standby
of each as `pdserve up` keeps. Every --kill-every-s the benchmark SIGKILLs the next of
--victims (prefill-0, decode-0, master, data-1, router-0, both decode workers, both prefill
workers: the last two empty a pool, so the router's wait for one, --pool-wait-s, runs), starts
them again --restart-after-s later, and times each to ready as a client needs it (fleet.py).

The load (workload.py, client.py): Poisson arrivals planned before the run and sent by
--num-clients client processes of their own at their planned times, the answers parsed there;
the rate sent is measured and reported beside the rate offered. The offered rate is
--capacity-fraction of the capacity an open-loop sweep finds first (soak.py: rising rates,
capacity = the highest rate the clients sent and the fleet served and completed). Requests are
plain completions, greedy streams, JSON-schema chat streams, seeded n = 2 streams and
completions with logprobs, in turn; every prompt is fresh but the n = 2 ones, which repeat
--n2-references requests run undisturbed before the kills.

Reports (checks.py, report.py): every answer against an independent reference by kind, every
failure by cause (a stream lost with the router that held it, timeouts, HTTP errors by status,
broken streams, wrong answers by kind; failures during worker kills apart), each kill's
restart-to-ready time and the requests its outage overlapped, goodput per 5-second window, and
after the run every KV block, hand-off lease, store lease and pin, and the store's integrity.
Prints a table, writes JSON and a plot next to --output, and prints the JSON last.
"""
