// One gRPC (HTTP/2) transport per service address, with the bearer token and TLS the servers take.
import type { Interceptor, Transport } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

/** The same limit as the servers' (64 MiB per message). */
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

export interface TlsOptions {
  /** PEM CA bundle to verify the server with; the system's CAs when absent. */
  readonly ca?: string | Buffer;
  /** PEM client certificate, for mutual TLS. */
  readonly cert?: string | Buffer;
  /** PEM private key of `cert`. */
  readonly key?: string | Buffer;
}

export interface ConnectOptions {
  /** `host:port` of the service. */
  readonly address: string;
  /** Bearer token the server expects, if any: sent as `authorization: Bearer <token>`. */
  readonly token?: string;
  /** Speak TLS (the server was started with a certificate). */
  readonly tls?: TlsOptions;
  /** Deadline of unary calls that pass no `timeoutMs`; streams get none. Default 30 s. */
  readonly defaultTimeoutMs?: number;
}

function bearer(token: string): Interceptor {
  return (next) => (request) => {
    request.header.set("authorization", `Bearer ${token}`);
    return next(request);
  };
}

/** A transport for the generated clients (`createClient(Service, transport)`) and this package's. */
export function createTransport(options: ConnectOptions): Transport {
  const { address, token, tls } = options;
  return createGrpcTransport({
    baseUrl: `${tls ? "https" : "http"}://${address}`,
    nodeOptions: tls ? { ca: tls.ca, cert: tls.cert, key: tls.key } : undefined,
    interceptors: token === undefined ? [] : [bearer(token)],
    defaultTimeoutMs: options.defaultTimeoutMs ?? 30_000,
    readMaxBytes: MAX_MESSAGE_BYTES,
    writeMaxBytes: MAX_MESSAGE_BYTES,
  });
}

/** Call options of a long-lived stream: no deadline (it ends by the server, or by `signal`). */
export function streamOptions(signal?: AbortSignal): { timeoutMs: number; signal?: AbortSignal } {
  return { timeoutMs: 0, signal };
}
