"""Reproducible studies, each one question about pdserve answered on the machine at hand (the
decode step against its floor, where TTFT goes, the KV hand-off's bandwidth, ...): run one with
`python -m benchmarks.<name>`; the latest answers are in docs/benchmarks.md.
`pdserve bench`, the harness that measures any server, is the package above."""
