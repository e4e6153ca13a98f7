import logging
from tests.e2e.test_session_linking import *  # noqa
from runtime.logs import JsonFormatter
from prometheus_client import REGISTRY, generate_latest

def test_logs(make_settings, db, caplog):
    caplog.set_level(logging.INFO)
    settings = make_settings()
    a, u, u2 = new_id(), new_id(), new_id()
    insert_session(db, anonymous_id=a)
    e1 = signed_in_envelope(user_id=u, anonymous_id=a)
    produce(settings, [sign_in(settings, e1), sign_in(settings, e1), sign_in(settings, signed_in_envelope(user_id=u, anonymous_id=a)), sign_in(settings, signed_in_envelope(user_id=u2, anonymous_id=a)), sign_in(settings, signed_in_envelope(user_id=u2, anonymous_id=new_id())), sign_in(settings, signed_in_envelope(user_id=u2, anonymous_id=uuid.UUID(int=0)))])
    run(build_flow(settings))
    f = JsonFormatter()
    for r in caplog.records:
        if r.name.startswith(("sinks.session", "dataflows.session")):
            print(f.format(r))
    print("\n".join(l for l in generate_latest().decode().splitlines() if "session_linking" in l and not l.startswith("#") and "bucket" not in l))
