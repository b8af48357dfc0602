"""The harness's /metrics reader (encoder_service/benchmarks/reliability/server.py), which the server tests and the
reliability scenarios read every gauge and counter through: a series /metrics does not show is an
error, not 0, so "back to 0" cannot pass on a metric that was renamed or dropped."""

from __future__ import annotations

import pytest

from encoder_service.benchmarks.reliability.server import EncoderProcess, MissingSeries

TEXT = """\
# HELP encoder_service_queue_images Images admitted and waiting.
# TYPE encoder_service_queue_images gauge
encoder_service_queue_images 0.0
# TYPE encoder_service_requests_total counter
encoder_service_requests_total{code="OK",method="Encode"} 3.0
encoder_service_requests_total{code="OK",method="Lookup"} 2.0
encoder_service_requests_total{code="CANCELLED",method="Encode"} 1.0
# TYPE encoder_service_images_total counter
encoder_service_images_total{model="a,b=\\"c\\"",source="patches"} 4.0
encoder_service_images_total{model="a,b=\\"c\\"",source="encoded"} 5.0
# TYPE encoder_service_sink_push_failures_total counter
# TYPE encoder_service_queue_seconds histogram
encoder_service_queue_seconds_count 7.0
"""


class Scraped(EncoderProcess):
    def __init__(self, text: str) -> None:  # no process: /metrics is the text given
        self._text = text

    def metrics_text(self) -> str:
        return self._text


def test_present_series_are_read_whatever_the_label_order_and_summed_over_labels_left_out():
    m = Scraped(TEXT)
    assert m.metric("encoder_service_queue_images") == 0.0
    assert m.metric("encoder_service_requests_total", 'method="Encode",code="OK"') == 3.0
    assert m.metric("encoder_service_requests_total", 'code="OK",method="Encode"') == 3.0
    assert m.metric("encoder_service_requests_total", 'code="OK"') == 5.0
    assert m.metric("encoder_service_requests_total") == 6.0
    assert m.metric("encoder_service_images_total", 'source="patches"') == 4.0
    assert m.metric("encoder_service_images_total", 'model="a,b=\\"c\\""') == 9.0
    assert m.metric("encoder_service_queue_seconds_count") == 7.0


@pytest.mark.parametrize("name,labels", [
    ("encoder_service_queue_image", ""),  # renamed
    ("encoder_service_requests", ""),  # the family name, not a series
    ("encoder_service_requests_total", 'code="OK",method="GetModelInfo"'),
    ("encoder_service_sink_push_failures_total", ""),  # labelled: no series before its first increment
    ("encoder_service_sink_push_failures_total", 'pattern="127.0.0.1:*",reason="unavailable"'),
])
def test_a_series_not_shown_is_an_error_unless_the_caller_allows_it(name, labels):
    m = Scraped(TEXT)
    with pytest.raises(MissingSeries, match=name):
        m.metric(name, labels)
    assert m.metric(name, labels, missing_ok=True) == 0.0


def test_labels_that_do_not_parse_are_an_error_not_a_match_on_everything():
    with pytest.raises(ValueError, match="labels"):
        Scraped(TEXT).metric("encoder_service_requests_total", "code=OK")
