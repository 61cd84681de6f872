// An EnvironmentService in TypeScript, from the protos alone: the guess_number game served over gRPC
// (HTTP/2, plaintext) with grpc.health.v1, on Connect-ES's Node adapter.
//
//   node server.js [--port 50054] [--host 127.0.0.1] [--ready-file F] [--max-episodes 256]
//                  [--lease-s 600] [--max-observation-bytes 1048576] [--low 1] [--high 16] [--turns 6]
//                  [--agent]
//
// With --agent it is an agent host instead (docs/agents.md): RunEpisode plays a whole episode of the
// game as an agent that runs its own loop with the `openai` npm package against the episode's
// base_url (agent.ts), and StartEpisode/StepEpisode are UNIMPLEMENTED.
//
// Once bound it prints `listening HOST:PORT` on stdout (and writes HOST:PORT to --ready-file);
// `--port 0` binds a free port. The server's settings also come from PIPELINERL_ENVIRONMENT_PORT,
// _HOST, _MAX_EPISODES, _LEASE_S and _MAX_OBSERVATION_BYTES, as the Python server's do; a flag wins.
// SIGTERM or SIGINT drains: health NOT_SERVING, new episodes UNAVAILABLE, then the process exits.
import { EventEmitter, once } from "node:events";
import { renameSync, writeFileSync } from "node:fs";
import * as http2 from "node:http2";
import type { AddressInfo } from "node:net";
import { parseArgs } from "node:util";
import { Code, ConnectError, type ConnectRouter } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import {
  Health,
  HealthCheckResponse_ServingStatus as ServingStatus,
} from "../../src/gen/health/v1/health_pb.js";
import {
  EnvironmentService,
  type RunEpisodeRequest,
  type RunEpisodeResponse,
} from "../../src/gen/pipelinerl/environment/v1/environment_pb.js";
import { playEpisode } from "./agent.js";
import { EpisodeTable, type Game } from "./episodes.js";
import { guessNumber } from "./game.js";

const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

const OPTIONS = {
  port: { type: "string" },
  host: { type: "string" },
  "ready-file": { type: "string" },
  "max-episodes": { type: "string" },
  "lease-s": { type: "string" },
  "max-observation-bytes": { type: "string" },
  low: { type: "string", default: "1" },
  high: { type: "string", default: "16" },
  turns: { type: "string", default: "6" },
  agent: { type: "boolean", default: false },
} as const;
const USAGE = `usage: server.js [--port 50054] [--host 127.0.0.1] [--ready-file F] [--max-episodes 256] [--lease-s 600]
                 [--max-observation-bytes 1048576] [--low 1] [--high 16] [--turns 6] [--agent]`;

function parsed() {
  try {
    return parseArgs({ options: OPTIONS });
  } catch (error) {
    console.error(`${(error as Error).message}\n${USAGE}`);
    process.exit(2);
  }
}
const { values } = parsed();

/** A flag, else its PIPELINERL_ENVIRONMENT_* variable, else the default; a number at least `min`. */
function setting(flag: keyof typeof values, fallback: number, min: number, integer = true): number {
  const env = `PIPELINERL_ENVIRONMENT_${flag.toUpperCase().replaceAll("-", "_")}`;
  const text = (values[flag] as string | undefined) ?? process.env[env];
  const value = text === undefined ? fallback : Number(text);
  if (!Number.isFinite(value) || value < min || (integer && !Number.isInteger(value))) {
    console.error(`--${flag} (${env}) is ${text}: it must be ${integer ? "an integer" : "a number"} of ${min} or more`);
    process.exit(2);
  }
  return value;
}

const host = values.host ?? process.env.PIPELINERL_ENVIRONMENT_HOST ?? "127.0.0.1";
const port = setting("port", 50054, 0);
function makeGame(): Game {
  try {
    return guessNumber({ low: Number(values.low), high: Number(values.high), turns: Number(values.turns) });
  } catch (error) {
    console.error(`--low, --high, --turns: ${(error as Error).message}`);
    process.exit(2);
  }
}
const table = new EpisodeTable(
  makeGame(),
  {
    maxEpisodes: setting("max-episodes", 256, 1),
    leaseS: setting("lease-s", 600, 0.01, false),
    maxObservationBytes: setting("max-observation-bytes", 1024 * 1024, 1),
  },
);
const { limits } = table;
const agent = values.agent;
const agentCounts = { running: 0, started: 0n, failures: 0n };
const notHere = () => new ConnectError("this server is an agent host: it runs whole episodes (RunEpisode)", Code.Unimplemented);

/** One RunEpisode: the game played by the agent; its failures are INTERNAL (the caller plays it again). */
async function runEpisode(request: RunEpisodeRequest, signal: AbortSignal): Promise<RunEpisodeResponse> {
  if (!agent) {
    throw new ConnectError("this server serves StartEpisode and StepEpisode; it runs no agent", Code.Unimplemented);
  }
  if (serving !== ServingStatus.SERVING) {
    throw new ConnectError("the host is draining", Code.Unavailable);
  }
  if (agentCounts.running >= limits.maxEpisodes) {
    throw new ConnectError(`the host runs ${agentCounts.running} episodes, its max_episodes`, Code.ResourceExhausted);
  }
  agentCounts.running += 1;
  agentCounts.started += 1n;
  try {
    return await playEpisode(table.game, request, signal);
  } catch (error) {
    agentCounts.failures += 1n;
    throw new ConnectError(`the agent failed: ${(error as Error).message}`, Code.Internal);
  } finally {
    agentCounts.running -= 1;
  }
}

// grpc.health.v1: SERVING for the server ("") and for the EnvironmentService, NOT_SERVING once draining.
const SERVICES = ["", EnvironmentService.typeName];
let serving = ServingStatus.SERVING;
const healthChanged = new EventEmitter();
const statusOf = (service: string) => (SERVICES.includes(service) ? serving : ServingStatus.SERVICE_UNKNOWN);

function routes(router: ConnectRouter): void {
  router.service(EnvironmentService, {
    describeEnvironment: () => ({
      name: table.game.name,
      version: table.game.version,
      description: table.game.description,
      tools: [...table.game.tools],
      maxTurns: table.game.maxTurns,
      maxEpisodes: limits.maxEpisodes,
      lease: { seconds: BigInt(Math.floor(limits.leaseS)), nanos: Math.round((limits.leaseS % 1) * 1e9) },
      maxObservationBytes: BigInt(limits.maxObservationBytes),
      agent,
    }),
    startEpisode: (request) => {
      if (agent) throw notHere();
      return table.start(request.episodeId, request.seed, request.task);
    },
    stepEpisode: (request) => {
      if (agent) throw notHere();
      return table.step(request.episodeId, request.turn, request.action);
    },
    runEpisode: (request, context) => runEpisode(request, context.signal),
    endEpisode: (request) => {
      table.end(request.episodeId);
      return {};
    },
    getStatus: () => ({
      activeEpisodes: agent ? agentCounts.running : table.active,
      maxEpisodes: limits.maxEpisodes,
      episodesStarted: agent ? agentCounts.started : table.counts.started,
      steps: table.counts.steps,
      episodesReaped: table.counts.reaped,
      failures: agent ? agentCounts.failures : table.counts.failures,
    }),
  });
  router.service(Health, {
    check: (request) => {
      if (!SERVICES.includes(request.service)) {
        throw new ConnectError(`unknown service ${request.service}`, Code.NotFound);
      }
      return { status: serving };
    },
    watch: async function* (request, context) {
      for (;;) {
        yield { status: statusOf(request.service) };
        try {
          await once(healthChanged, "change", { signal: context.signal });
        } catch {
          return; // the caller went away, or the server shuts down
        }
      }
    },
    list: () => ({
      statuses: Object.fromEntries(SERVICES.map((service) => [service, { status: serving }])),
    }),
  });
}

const shutdown = new AbortController();
const server = http2.createServer(
  connectNodeAdapter({
    routes,
    grpc: true,
    grpcWeb: false,
    connect: false,
    readMaxBytes: MAX_MESSAGE_BYTES,
    writeMaxBytes: MAX_MESSAGE_BYTES,
    shutdownSignal: shutdown.signal,
  }),
);
const sessions = new Set<http2.ServerHttp2Session>();
server.on("session", (session) => {
  sessions.add(session);
  session.on("close", () => sessions.delete(session));
});

const reaper = setInterval(() => {
  const reaped = table.reapIdle();
  if (reaped.length > 0) {
    console.error(`reaped ${reaped.length} idle episodes (lease ${limits.leaseS} s)`);
  }
}, Math.min(Math.max(limits.leaseS / 4, 0.01), 1) * 1000);

server.on("error", (error) => {
  console.error(`cannot serve on ${host}:${port}: ${error.message}`);
  process.exit(1);
});
server.listen(port, host, () => {
  const address = `${host}:${(server.address() as AddressInfo).port}`;
  if (values["ready-file"] !== undefined) {
    writeFileSync(`${values["ready-file"]}.tmp`, `${address}\n`);
    renameSync(`${values["ready-file"]}.tmp`, values["ready-file"]);
  }
  console.log(`listening ${address}`);
});

let draining = false;
function drain(signal: string): void {
  if (draining) {
    process.exit(1); // a second signal: at once
  }
  draining = true;
  console.error(`${signal}: draining`);
  table.stopStarting();
  serving = ServingStatus.NOT_SERVING;
  healthChanged.emit("change");
  clearInterval(reaper);
  // Every call is answered without waiting, so none is left in flight: stop listening, let the
  // streams open now (health watches, told NOT_SERVING) end, and close every connection.
  setImmediate(() => {
    shutdown.abort();
    server.close(() => process.exit(0));
    for (const session of sessions) {
      session.close();
    }
  });
  setTimeout(() => process.exit(0), 5000).unref();
}
process.on("SIGTERM", () => drain("SIGTERM"));
process.on("SIGINT", () => drain("SIGINT"));
