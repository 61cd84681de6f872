// The command-line options every example takes: where the server is, its token, its TLS CA.
import { readFileSync } from "node:fs";
import type { Transport } from "@connectrpc/connect";
import { createTransport } from "../src/index.js";

/** `parseArgs` options: `--address host:port`, `--token TOKEN`, `--tls-ca ca.pem`. */
export const connectOptions = {
  address: { type: "string" },
  token: { type: "string" },
  "tls-ca": { type: "string" },
} as const;

export function transportOf(values: { address?: string; token?: string; "tls-ca"?: string }): Transport {
  if (values.address === undefined) {
    throw new Error("--address host:port is required");
  }
  const ca = values["tls-ca"];
  return createTransport({
    address: values.address,
    token: values.token,
    tls: ca === undefined ? undefined : { ca: readFileSync(ca) },
  });
}
