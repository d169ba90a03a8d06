"""The spec is a value (§4.1-§4.8): generate(), the Engine, the monitors and the checker take one
`Spec` (every machine's table), so the shipped tables and an edited copy run side by side in one
process, each run following its own tables and neither changing what the other does. Without one
they follow `default_spec()`, the spec directory's tables, loaded once."""

from __future__ import annotations

import pytest
from _spec_kit import edited_spec

from decodespec.properties import check_trace
from decodespec.runtime import ByteTableTokenizer, Engine, Request, ScriptedModel, generate
from decodespec.spec import MACHINES, FinishReason, Spec, SpecError, default_spec, load_spec
from decodespec.spec.loader import SPEC_DIR

TOK = ByteTableTokenizer({1: b"x", 2: b"A", 3: b"B", 5: b""}, eos_id=5)
FLUSH = 'state = "HOLDING"\nevent = "flush"\ntarget = "FLUSHED"\naction = "emit_held"'
# The stop matcher's `flush` from HOLDING drops the held bytes instead of sending them (§4.3
# flush_safe_suffix turned into discard_from_first_match).
DROPS_HELD = edited_spec({"stop_matcher": lambda t: t.replace(FLUSH, FLUSH.replace("emit_held", "discard_from_match"))})


def _request() -> Request:
    """Output "xA" then the length limit: the "A" is held as the start of the stop "AB" (§4.6)."""
    return Request([1], max_output_tokens=2, stop=["AB"])


def _generated(spec: Spec | None = None) -> tuple:
    r = generate(_request(), model=ScriptedModel([1, 2], vocab_size=6), tokenizer=TOK, spec=spec)
    return r.finish_reason, r.output, sorted({v.invariant for v in check_trace(r.trace, tokenizer=TOK, spec=spec)})


def _served(spec: Spec | None = None) -> tuple:
    engine = Engine(ScriptedModel([1, 2], vocab_size=6), TOK, spec=spec)
    run = engine.submit(_request())
    engine.run_until_idle()
    r = run.result()
    return r.finish_reason, r.output, sorted({v.invariant for v in check_trace(r.trace, tokenizer=TOK, spec=spec)})


def test_the_shipped_tables_and_an_edited_stop_table_run_side_by_side_in_one_process():
    """§4.3, §4.6: at the length limit the shipped table sends the held "A"; the edited one drops
    it, which the monitors find (§4.5: the streamed bytes are not the batch decode). Interleaved,
    each run follows its own spec and neither changes what the other does."""
    shipped = (FinishReason.MAX_OUTPUT_TOKENS, b"xA", [])
    edited = (FinishReason.MAX_OUTPUT_TOKENS, b"x", ["detok_concat_equals_batch"])
    for _ in range(2):  # neither leaves anything behind for the other
        assert _generated() == shipped
        assert _generated(DROPS_HELD) == edited
        assert _served(DROPS_HELD) == edited
        assert _served(default_spec()) == shipped


def test_a_run_carries_the_spec_it_follows():
    engine = Engine(ScriptedModel([1, 2], vocab_size=6), TOK, spec=DROPS_HELD)
    assert engine.spec is DROPS_HELD and engine.submit(_request()).spec is DROPS_HELD
    assert Engine(ScriptedModel([1, 2], vocab_size=6), TOK).spec is default_spec()


def test_the_default_spec_is_the_spec_directorys_tables_loaded_once():
    assert default_spec() is default_spec()
    assert all(default_spec()[name] is load_spec(name) for name in MACHINES)
    loaded = Spec.load(SPEC_DIR)
    assert all(loaded[name].decisions == load_spec(name).decisions for name in MACHINES)


def test_a_spec_without_every_machine_or_with_a_misnamed_table_is_refused_by_name():
    tables = dict(default_spec().tables)
    del tables["stream"]
    with pytest.raises(SpecError, match=r"missing \['stream'\]"):
        Spec(tables, "partial")
    with pytest.raises(SpecError, match=r"misnamed \['stream'\]"):
        Spec({**tables, "stream": load_spec("stop_matcher")}, "swapped")
    with pytest.raises(SpecError, match="no such machine 'streams'"):
        default_spec()["streams"]


def test_the_ledger_and_the_checker_release_the_model_kinds_of_their_own_resources_table():
    """§4.10: the kinds released before the terminal event are the resources table's model_kinds,
    of the spec a run or a check is given, beside the spec directory's in the same process."""
    from decodespec.machine.checker_model import Model
    from decodespec.runtime.ledger import ResourceLedger

    shipped = 'model_kinds = ["kv_cache", "batch_slot", "rng_state"]'
    spec = edited_spec({"resources": lambda t: t.replace(shipped, 'model_kinds = ["kv_cache", "batch_slot"]')})
    edited, plain = ResourceLedger("r", table=spec["resources"]), ResourceLedger("r")
    assert (edited.model_kinds, edited.stream_kinds) == (("kv_cache", "batch_slot"),
                                                         ("rng_state", "stream_buffer", "trace_handle"))
    assert (plain.model_kinds, plain.stream_kinds) == (("kv_cache", "batch_slot", "rng_state"),
                                                       ("stream_buffer", "trace_handle"))
    assert (Model(spec).model_kinds, Model().model_kinds) == (edited.model_kinds, plain.model_kinds)
    assert Model(spec).tables["resources"] is spec["resources"]


def test_the_server_serves_the_spec_of_its_engine_beside_a_server_of_the_shipped_one():
    """§4.6 over HTTP: two servers in one process, one whose Engine runs the edited stop table;
    the same completion ends "xA" on the shipped one and "x" on the edited one."""
    import httpx
    from _engine_kit import serve_in_thread

    from decodespec.runtime.server import create_app

    def served(spec: Spec | None) -> str:
        app = create_app(Engine(ScriptedModel([1, 2], vocab_size=6), TOK, spec=spec), model_name="scripted")
        with serve_in_thread(app) as base:
            r = httpx.post(f"{base}/v1/completions", json={"model": "scripted", "prompt": [1], "max_tokens": 2,
                                                            "stop": ["AB"], "temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert (served(None), served(DROPS_HELD)) == ("xA", "x")
