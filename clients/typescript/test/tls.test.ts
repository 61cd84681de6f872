// TLS and the bearer token pass through the transport, against a reward service that requires both.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { createClient } from "@connectrpc/connect";
import { RewardService } from "../src/gen/pipelinerl/reward/v1/reward_pb.js";
import { Code, createTransport, fromCallError, type TlsOptions } from "../src/index.js";
import { startService, type Service } from "./services.js";

const TOKEN = "ts-tls";
const dir = mkdtempSync(join(tmpdir(), "pipelinerl-ts-tls-"));
let reward: Service;
let ca: Buffer;

before(async () => {
  const [cert, key] = [join(dir, "cert.pem"), join(dir, "key.pem")];
  // A self-signed certificate for 127.0.0.1, which is its own CA.
  execFileSync("openssl", ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert], { stdio: "ignore" });
  ca = readFileSync(cert);
  reward = await startService("reward", "--tls-cert-file", cert, "--tls-key-file", key, "--auth-token", TOKEN);
}, { timeout: 120_000 });

after(async () => {
  await reward?.stop();
  rmSync(dir, { recursive: true, force: true });
});

function verifiers(token: string, tls?: TlsOptions) {
  return createClient(RewardService, createTransport({ address: reward.address, token, tls })).listVerifiers({});
}

test("a client with the CA and the token is served over TLS", async () => {
  assert.ok((await verifiers(TOKEN, { ca })).verifiers.length > 0);
});

test("without the token it is UNAUTHENTICATED; in plaintext it is not served", async () => {
  const unauthenticated = (error: unknown) => fromCallError(error).code === Code.Unauthenticated;
  await assert.rejects(verifiers("wrong", { ca }), unauthenticated);
  await assert.rejects(verifiers(TOKEN));
});
