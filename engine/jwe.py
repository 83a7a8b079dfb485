"""JWE compact serialization for one purpose: a database session's URL sent to the runner that
asked for it (SPEC §17). Pure: no I/O.

How it works (RFC 7516 / 7518, the one algorithm pair we accept)
- The runner makes an RSA key pair for its process (`generate_key`), keeps the private key in
  memory and sends the public half as a JWK `{"kty": "RSA", "n", "e"}`.
- `encrypt` draws a fresh 256-bit content key and a 96-bit IV, encrypts the plaintext with
  AES-256-GCM (`enc` `A256GCM`) using the ASCII of the encoded protected header as additional
  authenticated data, and wraps the content key with RSA-OAEP-SHA256 (`alg` `RSA-OAEP-256`).
  Extra header members (the session's `org`, `play`, `expires_at`) ride in the protected header,
  so they are authenticated together with the ciphertext.
- `decrypt` refuses any other `alg`/`enc` and any tampering (`InvalidInputError`); it returns
  the protected header and the plaintext.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import InvalidInputError

ALG = "RSA-OAEP-256"
ENC = "A256GCM"
MIN_KEY_BITS = 2048
_OAEP = padding.OAEP(mgf=padding.MGF1(algorithm=hashes.SHA256()), algorithm=hashes.SHA256(), label=None)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str, what: str) -> bytes:
    if not isinstance(text, str) or not all(c.isalnum() or c in "-_" for c in text):
        raise InvalidInputError(f"{what} is not base64url text")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError as exc:
        raise InvalidInputError(f"{what} is not base64url text") from exc


def _int_b64(value: int) -> str:
    return b64url(value.to_bytes((value.bit_length() + 7) // 8, "big"))


def generate_key(bits: int = 2048) -> tuple[rsa.RSAPrivateKey, dict[str, str]]:
    """A fresh RSA key pair: the private key (keep it in memory) and its public JWK."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    return private, public_jwk(private.public_key())


def public_jwk(key: rsa.RSAPublicKey) -> dict[str, str]:
    numbers = key.public_numbers()
    return {"kty": "RSA", "n": _int_b64(numbers.n), "e": _int_b64(numbers.e)}


def load_public_jwk(jwk: Any) -> rsa.RSAPublicKey:
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
        return rsa.RSAPublicNumbers(e, n).public_key()
    except ValueError as exc:
        raise InvalidInputError(f"public_key is not a valid RSA key: {exc}") from exc


def encrypt(plaintext: bytes, jwk: Any, header: dict[str, Any] | None = None) -> str:
    """The JWE compact serialization of `plaintext` for the holder of `jwk`'s private key."""
    key = load_public_jwk(jwk)
    protected = {"alg": ALG, "enc": ENC, **(header or {})}
    encoded_header = b64url(json.dumps(protected, separators=(",", ":"), sort_keys=True).encode())
    content_key = AESGCM.generate_key(bit_length=256)
    iv = os.urandom(12)
    sealed = AESGCM(content_key).encrypt(iv, plaintext, encoded_header.encode("ascii"))
    ciphertext, tag = sealed[:-16], sealed[-16:]
    wrapped = key.encrypt(content_key, _OAEP)
    return ".".join((encoded_header, b64url(wrapped), b64url(iv), b64url(ciphertext), b64url(tag)))


def decrypt(token: str, private_key: rsa.RSAPrivateKey) -> tuple[dict[str, Any], bytes]:
    """`(protected header, plaintext)`; `InvalidInputError` for anything but an intact JWE
    made for this key with `RSA-OAEP-256` + `A256GCM`."""
    parts = token.split(".") if isinstance(token, str) else []
    if len(parts) != 5:
        raise InvalidInputError("not a JWE compact serialization (five dot-separated parts)")
    encoded_header, wrapped, iv, ciphertext, tag = parts
    try:
        header = json.loads(b64url_decode(encoded_header, "JWE header"))
    except ValueError as exc:
        raise InvalidInputError("the JWE header is not JSON") from exc
    if not isinstance(header, dict) or header.get("alg") != ALG or header.get("enc") != ENC:
        raise InvalidInputError(f"the JWE must use alg {ALG} and enc {ENC}")
    iv_bytes = b64url_decode(iv, "JWE iv")
    if len(iv_bytes) != 12:
        raise InvalidInputError("the JWE iv must be 96 bits")
    try:
        content_key = private_key.decrypt(b64url_decode(wrapped, "JWE encrypted key"), _OAEP)
        if len(content_key) != 32:
            raise ValueError("content key is not 256 bits")
        plaintext = AESGCM(content_key).decrypt(
            iv_bytes,
            b64url_decode(ciphertext, "JWE ciphertext") + b64url_decode(tag, "JWE tag"),
            encoded_header.encode("ascii"),
        )
    except (ValueError, InvalidTag) as exc:
        raise InvalidInputError("the JWE does not decrypt with this key (wrong key or tampered)") from exc
    return header, plaintext
