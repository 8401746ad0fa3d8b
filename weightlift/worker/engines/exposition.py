"""An engine's own Prometheus families on the worker's /metrics (vLLM's `vllm:*`, Triton's
`nv_*`): parsed with prometheus_client's text parser, kept by name prefix, and written back in
the Prometheus text format with the replica's labels (`deployment`, `replica`) on every sample,
so a query can tell one replica's engine from another's however the scraper labels targets.

Written back here rather than by prometheus_client's `generate_latest`: its parser turns a
counter whose TYPE line has no `_total` (Triton's `nv_inference_request_success`) into samples
named `..._total`, which `generate_latest` would then expose under that new name. This keeps
the engine's own names: such a counter's original TYPE name is read off its TYPE line. Only
names valid in the classic text format are written (`[a-zA-Z_:][a-zA-Z0-9_:]*`: vLLM's colons
are valid and stay as they are); a family with any other metric or label name is left out, and
text the parser refuses gives nothing, never a /metrics that Prometheus would reject as a whole.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# The names of counters as their TYPE lines give them (with or without `_total`).
_COUNTER_TYPE = re.compile(r"^#[ \t]*TYPE[ \t]+(\S+)[ \t]+counter[ \t]*$", re.M)
_TEXT_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}
_TOTAL = "_total"


def replica_labels(deployment: str, replica: int) -> dict[str, str]:
    """What every re-exported sample carries: the pod's weightlift.dev/deployment and
    weightlift.dev/replica labels, by the names the PodMonitor's relabelling gives them."""
    return {"deployment": deployment, "replica": str(replica)}


def relabel(text: str, prefixes: tuple[str, ...], labels: Mapping[str, str]) -> str:
    """The families of exposition `text` whose names start with one of `prefixes`, each sample
    with `labels` added (replacing an engine label of the same name), as Prometheus text."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError) as exc:  # what the parser raises on text it cannot read
        log.warning("engine metrics left out: unreadable exposition (%s)", exc)
        return ""
    counters = set(_COUNTER_TYPE.findall(text))
    out: list[str] = []
    for family in families:
        if family.name.startswith(prefixes):
            out.extend(_family(family, counters, labels))
    return "".join(out)


def _family(family: Metric, counters: set[str], labels: Mapping[str, str]) -> Iterator[str]:
    name, kind, samples = family.name, family.type, list(family.samples)
    if kind == "counter":
        if name in counters:  # TYPE line without _total: the parser added it to each sample
            samples = [s._replace(name=s.name[: -len(_TOTAL)]) for s in samples]
        else:  # the parser took _total off the family's name; its samples keep theirs
            name += _TOTAL
    elif kind not in _TEXT_TYPES:
        kind = "untyped"
    merged = [s._replace(labels={**s.labels, **labels}) for s in samples]
    names = {name, *(s.name for s in merged)}
    label_names = {k for s in merged for k in s.labels}
    if not all(METRIC_NAME.fullmatch(n) for n in names) or not all(
        LABEL_NAME.fullmatch(k) for k in label_names
    ):
        log.debug("engine family %r left out: a name the text format cannot carry", name)
        return
    help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    yield f"# HELP {name} {help_text}\n"
    yield f"# TYPE {name} {kind}\n"
    for sample in merged:
        yield _sample_line(sample)


def _sample_line(sample: Sample) -> str:
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
    line = f"{sample.name}{{{pairs}}}" if pairs else sample.name
    line += f" {floatToGoString(sample.value)}"
    if sample.timestamp is not None:  # the parser's seconds; the text format's milliseconds
        line += f" {round(float(sample.timestamp) * 1000)}"
    return line + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
