"""JWE compact serialization for one purpose: a database session's URL sent to the runner that
asked for it. Pure: no I/O.

How it works (RFC 7516 / 7518, through `joserfc`; the one algorithm pair we accept)
- The runner makes an RSA key pair for its process (`generate_key`), keeps the private key in
  memory and sends the public half as a JWK `{"kty": "RSA", "n", "e"}`.
- `encrypt` seals the plaintext with `alg` `RSA-OAEP-256` (the content key wrapped with
  RSA-OAEP-SHA256) and `enc` `A256GCM` (AES-256-GCM with the encoded protected header as
  additional authenticated data). Extra header members (the session's `org`, `play`,
  `expires_at`) ride in the protected header, so they are authenticated with the ciphertext.
- `decrypt` refuses any other `alg`/`enc` and any tampering (`InvalidInputError`); it returns
  the protected header and the plaintext.
- The public JWK is checked member by member here (kty, base64url, a modulus of at least 2048
  bits, a usable exponent) so a bad key is refused with a message naming the member, before the
  library sees it. `tests/test_session_lifecycle.py` decrypts our output with plain
  `cryptography` primitives, so the wire format is the standard one whatever library makes it.
"""

from __future__ import annotations

import base64
import json

from joserfc import jwe as _jwe
from joserfc.errors import JoseError
from joserfc.jwk import RSAKey
from joserfc.registry import HeaderParameter

from ..canonical import JsonObject, JsonValue
from ..errors import InvalidInputError

ALG = "RSA-OAEP-256"
ENC = "A256GCM"
MIN_KEY_BITS = 2048
# The header members a session's JWE carries besides alg and enc (authenticated, not secret).
_REGISTRY = _jwe.JWERegistry(
    algorithms=[ALG, ENC],
    header_registry={
        "org": HeaderParameter("the session's org", "str"),
        "play": HeaderParameter("the session's play", "str"),
        "expires_at": HeaderParameter("when the session expires", "str"),
    },
)

PrivateKey = RSAKey


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str, what: str) -> bytes:
    if not isinstance(text, str) or not all(c.isalnum() or c in "-_" for c in text):
        raise InvalidInputError(f"{what} is not base64url text")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError as exc:
        raise InvalidInputError(f"{what} is not base64url text") from exc


def generate_key(bits: int = 2048) -> tuple[PrivateKey, dict[str, str]]:
    """A fresh RSA key pair: the private key (keep it in memory) and its public JWK."""
    private = RSAKey.generate_key(bits)
    public = private.as_dict(private=False)
    return private, {"kty": "RSA", "n": public["n"], "e": public["e"]}


def load_public_jwk(jwk: JsonValue) -> RSAKey:
    """The RSA public key of a JWK; `InvalidInputError` naming the member that is wrong."""
    if not isinstance(jwk, dict) or jwk.get("kty") != "RSA":
        raise InvalidInputError('public_key must be a JWK object with "kty": "RSA"')
    n = int.from_bytes(b64url_decode(jwk.get("n"), "public_key.n"), "big")
    e = int.from_bytes(b64url_decode(jwk.get("e"), "public_key.e"), "big")
    if n.bit_length() < MIN_KEY_BITS:
        raise InvalidInputError(f"public_key.n must be an RSA modulus of at least {MIN_KEY_BITS} bits")
    if e < 3 or e % 2 == 0:
        raise InvalidInputError("public_key.e is not a usable RSA exponent")
    try:
        return RSAKey.import_key({"kty": "RSA", "n": jwk["n"], "e": jwk["e"]})
    except (JoseError, ValueError) as exc:
        raise InvalidInputError(f"public_key is not a valid RSA key: {exc}") from exc


def encrypt(plaintext: bytes, jwk: JsonValue, header: JsonObject | None = None) -> str:
    """The JWE compact serialization of `plaintext` for the holder of `jwk`'s private key."""
    key = load_public_jwk(jwk)
    protected = {"alg": ALG, "enc": ENC, **(header or {})}
    return _jwe.encrypt_compact(protected, plaintext, key, registry=_REGISTRY)


def decrypt(token: str, private_key: PrivateKey) -> tuple[JsonObject, bytes]:
    """`(protected header, plaintext)`; `InvalidInputError` for anything but an intact JWE
    made for this key with `RSA-OAEP-256` + `A256GCM`."""
    parts = token.split(".") if isinstance(token, str) else []
    if len(parts) != 5:
        raise InvalidInputError("not a JWE compact serialization (five dot-separated parts)")
    try:
        header = json.loads(b64url_decode(parts[0], "JWE header"))
    except ValueError as exc:
        raise InvalidInputError("the JWE header is not JSON") from exc
    if not isinstance(header, dict) or header.get("alg") != ALG or header.get("enc") != ENC:
        raise InvalidInputError(f"the JWE must use alg {ALG} and enc {ENC}")
    try:
        sealed = _jwe.decrypt_compact(token, private_key, registry=_REGISTRY)
    except (JoseError, ValueError) as exc:
        raise InvalidInputError("the JWE does not decrypt with this key (wrong key or tampered)") from exc
    return dict(sealed.protected), sealed.plaintext
