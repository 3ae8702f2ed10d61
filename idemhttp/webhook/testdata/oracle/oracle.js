// The oracle of idem's webhook interop tests (oracle_test.go, run by
// .ci/webhooks): code nobody at idem wrote signs and verifies deliveries,
// one request per line of stdin, one answer per line of stdout, as JSON.
//
//   sign:       the standardwebhooks package (the specification's
//               reference implementation, pinned in package-lock.json)
//               signs v1 with a whsec_ secret;
//   verify:     the same package verifies a delivery's headers (v1 only,
//               with its own 5-minute tolerance on the real clock);
//   sign-v1a:   Node's crypto (OpenSSL) signs v1a with an ed25519 seed;
//   verify-v1a: Node's crypto verifies each v1a signature of a
//               webhook-signature header with an ed25519 public key.
//
// Payloads travel in base64, and reach the package as Buffers.
"use strict";
const crypto = require("crypto");
const readline = require("readline");
const { Webhook } = require("standardwebhooks");

// DER prefixes of an ed25519 private key (PKCS #8) and public key (SPKI).
const pkcs8Prefix = Buffer.from("302e020100300506032b657004220420", "hex");
const spkiPrefix = Buffer.from("302a300506032b6570032100", "hex");

function content(req) {
  return Buffer.concat([Buffer.from(`${req.id}.${req.timestamp}.`), Buffer.from(req.payload_b64, "base64")]);
}

function handle(req) {
  const payload = Buffer.from(req.payload_b64, "base64");
  switch (req.op) {
    case "sign":
      return { signature: new Webhook(req.secret).sign(req.id, new Date(req.timestamp * 1000), payload) };
    case "verify":
      try {
        new Webhook(req.secret).verify(payload, req.headers, { jsonParse: false });
        return { ok: true };
      } catch (e) {
        return { ok: false, error: String(e && e.message) };
      }
    case "sign-v1a": {
      const key = crypto.createPrivateKey({
        key: Buffer.concat([pkcs8Prefix, Buffer.from(req.seed_b64, "base64")]), format: "der", type: "pkcs8",
      });
      return { signature: "v1a," + crypto.sign(null, content(req), key).toString("base64") };
    }
    case "verify-v1a": {
      const key = crypto.createPublicKey({
        key: Buffer.concat([spkiPrefix, Buffer.from(req.public_b64, "base64")]), format: "der", type: "spki",
      });
      for (const entry of req.header.split(" ")) {
        const [version, sig] = entry.split(",");
        if (version === "v1a" && sig && crypto.verify(null, content(req), key, Buffer.from(sig, "base64"))) {
          return { ok: true };
        }
      }
      return { ok: false, error: "no v1a signature verifies" };
    }
  }
  return { error: `unknown op ${req.op}` };
}

const lines = readline.createInterface({ input: process.stdin });
lines.on("line", (line) => {
  let answer;
  try {
    answer = handle(JSON.parse(line));
  } catch (e) {
    answer = { error: String(e && e.stack) };
  }
  process.stdout.write(JSON.stringify(answer) + "\n");
});
