"""Caller identity where a sidecar ends TLS (mesh/caller_token.py): a token signed with the
caller's mesh key proves who calls which method, for a minute; anything else proves
nothing. Then the real allow-lists over plaintext with tokens, as under mutual TLS."""

from __future__ import annotations

import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from mesh.authz import OPERATOR
from mesh.caller_token import TOKEN_TTL_S, TokenSigner, TokenVerifier
from mesh.config import MeshSettings, TlsSettings
from mesh.pki import throwaway_pki
from tests.harness import InProcess
from tests.mesh.test_authz import _code, _kv_worker, assert_prefills_allow_list

pytestmark = pytest.mark.unit

PULL = "/aimesh.llm.v1.KvCacheService/Pull"
RELEASE = "/aimesh.llm.v1.KvCacheService/Release"


@pytest.fixture
def pki(tmp_path):
    return throwaway_pki(tmp_path / "mesh", ["prefill", "decode"])


def test_a_token_names_its_signer_for_its_method_only(pki):
    now = [time.time()]
    verifier = TokenVerifier(pki["prefill"], clock=lambda: now[0])
    signer = TokenSigner(pki["decode"], clock=lambda: now[0])
    token = signer.token(PULL)
    assert verifier.verify(token, PULL) == "decode"
    assert verifier.verify(token, RELEASE) is None  # for Pull only
    assert signer.token(PULL) == token  # reused while it has life left
    now[0] += TOKEN_TTL_S / 2 + 1
    renewed = signer.token(PULL)
    assert renewed != token and verifier.verify(renewed, PULL) == "decode"
    assert verifier.verify(token[:-4] + "AAAA", PULL) is None  # tampered
    assert verifier.verify("not a token", PULL) is None
    fresh = TokenVerifier(pki["prefill"], clock=lambda: now[0] + TOKEN_TTL_S + 31)
    assert fresh.verify(renewed, PULL) is None  # expired, past the leeway


def test_the_signers_tokens_are_bounded_and_tokens_need_allow_lists(pki):
    """The edge signs for any method path a key holder sends: its table stays bounded.
    Tokens without allow-lists would leave a plaintext port open to anyone: refused."""
    from mesh.caller_token import SIGNED_TOKENS

    signer = TokenSigner(pki["decode"])
    for n in range(SIGNED_TOKENS * 3):
        signer.token(f"/aimesh.llm.v1.GenerationService/Bogus{n}")
    assert len(signer._tokens) == SIGNED_TOKENS
    with pytest.raises(ValueError, match="serve anyone"):
        TlsSettings.model_validate(
            {**pki["decode"].model_dump(), "caller_tokens": True, "authorize_callers": False}
        )


def test_a_certificate_of_another_ca_or_a_borrowed_name_proves_nothing(pki, tmp_path):
    verifier = TokenVerifier(pki["prefill"])
    stranger = throwaway_pki(tmp_path / "stranger", ["decode"])["decode"]
    assert verifier.verify(TokenSigner(stranger).token(PULL), PULL) is None
    # A member of a mesh (generation, its CA) signing a claim to be decode.
    own = throwaway_pki(tmp_path / "other-mesh", ["generation"])["generation"]
    verifier = TokenVerifier(own)
    header = jwt.get_unverified_header(TokenSigner(own).token(PULL))
    key = serialization.load_pem_private_key(own.key_file.read_bytes(), None)
    now = int(time.time())
    claims = {"sub": "spiffe://aimesh/decode", "aud": PULL, "iat": now, "exp": now + 60}
    forged = jwt.encode(claims, key, algorithm="ES256", headers={"x5c": header["x5c"]})
    assert verifier.verify(forged, PULL) is None
    claims["sub"] = "spiffe://aimesh/generation"  # its own name: the same token is good
    honest = jwt.encode(claims, key, algorithm="ES256", headers={"x5c": header["x5c"]})
    assert verifier.verify(honest, PULL) == "generation"
    claims["exp"] = now + 3600  # longer-lived than any signer makes: refused
    lasting = jwt.encode(claims, key, algorithm="ES256", headers={"x5c": header["x5c"]})
    assert verifier.verify(lasting, PULL) is None


@pytest.mark.service
async def test_prefill_serves_its_declared_callers_only_by_their_tokens(tmp_path):
    """Prefill's real allow-list over plaintext, each caller proving itself by token: only
    decode pulls KV, the router prefills and releases; no token or a stranger's is
    UNAUTHENTICATED."""
    pki = throwaway_pki(tmp_path, ["prefill", "decode", "generation", OPERATOR])
    as_ = {
        name: MeshSettings(tls=tls.model_copy(update={"caller_tokens": True}))
        for name, tls in pki.items()
    }
    stranger = throwaway_pki(tmp_path / "other", ["decode"])["decode"]
    async with InProcess() as services:
        served = await services.start("prefill", as_["prefill"], setup=_kv_worker)
        target = served.target
        await assert_prefills_allow_list(target, as_)
        assert (await _code(target, MeshSettings(), "Pull")).code().name == "UNAUTHENTICATED"
        other = MeshSettings(tls=stranger.model_copy(update={"caller_tokens": True}))
        assert (await _code(target, other, "Pull")).code().name == "UNAUTHENTICATED"
