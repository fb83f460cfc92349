"""The HDF5 trace format: schema, writer and lazy reader. Imports neither the engine nor the app.

    with TraceWriter(path, RunMetadata(decode_config, model_config, ...)) as w:   # traces.writer
        w.write_step(record)                              # per step, flushed (SWMR: readable live)
        w.finish(output_tokens, golden_tokens)
    with open_trace(path) as r:                           # traces.reader, read-only
        r.metadata, r.num_steps, r.step(i), r.column("tau"), r.summary(), r.refresh()

docs/trace-format.md documents every attribute and dataset.
"""
from kdspec.traces.reader import StepRecord, TraceReader, open_trace
from kdspec.traces.report import check, info_json, info_text
from kdspec.traces.schema import SCHEMA_VERSION, STEP_FIELDS, TraceDims, TraceError
from kdspec.traces.summary import TraceSummary, summarize
from kdspec.traces.writer import RunMetadata, TraceWriter

__all__ = ["SCHEMA_VERSION", "STEP_FIELDS", "RunMetadata", "StepRecord", "TraceDims", "TraceError", "TraceReader",
           "TraceSummary", "TraceWriter", "check", "info_json", "info_text", "open_trace", "summarize"]
