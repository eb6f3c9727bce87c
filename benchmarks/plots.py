"""A PNG of a benchmark's results (needs matplotlib)."""


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "serving" in result:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for server, rates in result["serving"].items():
            for ax, key in zip(axes, ("ttft_99_ms", "itl_99_ms")):
                ax.plot(
                    list(rates),
                    [r[key] for r in rates.values()],
                    marker="o",
                    label=server,
                )
        for ax, title in zip(axes, ("TTFT p99", "inter-token latency p99")):
            ax.set(xlabel="request rate (req/s)", ylabel="ms", title=title)
            ax.legend()
    elif "steps" in result:
        decode = [r for r in result["steps"] if r["kind"].startswith("decode")]
        fig, ax = plt.subplots(figsize=(6, 4))
        for backend in sorted({r["backend"] for r in decode}):
            rows = [r for r in decode if r["backend"] == backend]
            batches = [int(r["kind"].split("=")[1]) for r in rows]
            ax.plot(
                batches,
                [b / (r["ms"] / 1e3) for b, r in zip(batches, rows)],
                marker="o",
                label=backend,
            )
        ax.set(
            xlabel="batch size",
            ylabel="decode tok/s",
            xscale="log",
            title="decode throughput by batch size",
        )
        ax.legend()
    else:
        engines = {
            k: v for k, v in result["engines"].items() if "output_tok_per_s" in v
        }
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(engines), [v["output_tok_per_s"] for v in engines.values()])
        ax.set(
            ylabel="output tok/s",
            title=f"{result['workload']['num_requests']} requests on "
            f"{result['device']['device']}",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
