"""--ssl-* files are read before the engine starts, and a bad one is named with its flag (uvicorn only reads them
after the model has loaded, and says "[Errno 2] No such file or directory" without a path)."""
from __future__ import annotations

import pytest

from tokenmill.config.frontend import FrontendConfig


def test_a_good_pair_loads_and_no_certificate_means_nothing_to_check(tls_pair):
    key, cert = tls_pair
    FrontendConfig(ssl_keyfile=key, ssl_certfile=cert, ssl_ca_certs=cert).check_tls_files()
    FrontendConfig().check_tls_files()


def test_missing_or_unreadable_files_are_named_with_their_flag(tls_pair, tmp_path):
    key, cert = tls_pair
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = ((dict(ssl_keyfile="/nope/key.pem", ssl_certfile=cert), "--ssl-keyfile /nope/key.pem: no such file"),
             (dict(ssl_keyfile=key, ssl_certfile="/nope/cert.pem"), "--ssl-certfile /nope/cert.pem: no such file"),
             (dict(ssl_certfile=cert, ssl_ca_certs="/nope/ca.pem"), "--ssl-ca-certs /nope/ca.pem: no such file"),
             (dict(ssl_keyfile=key, ssl_certfile=str(junk)), f"--ssl-certfile {junk} with --ssl-keyfile {key}: "
                                                             "cannot load"),
             (dict(ssl_keyfile=key, ssl_certfile=cert, ssl_ca_certs=str(junk)), f"--ssl-ca-certs {junk}: cannot"))
    for kwargs, said in cases:
        with pytest.raises(ValueError) as e:
            FrontendConfig(**kwargs).check_tls_files()
        assert str(e.value).startswith(said), kwargs


def test_serve_stops_before_the_engine_with_one_line(monkeypatch):
    from tokenmill.entrypoints.openai import api_server
    said: list[str] = []
    monkeypatch.setattr(api_server.logger, "error", lambda msg, *args: said.append(msg % args))
    # The model does not exist: reaching the engine would log "Cannot start the engine" instead.
    with pytest.raises(SystemExit) as e:
        api_server.run_server({"model": "/nonexistent/model"},
                              FrontendConfig(ssl_keyfile="/nope/key.pem", ssl_certfile="/nope/cert.pem"))
    assert e.value.code == 1
    assert said == ["Cannot start the server: --ssl-certfile /nope/cert.pem: no such file."]
