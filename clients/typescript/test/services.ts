// Real services on 127.0.0.1: the four of a run, started by harness.py and stopped through its
// stdin; or one service alone, stopped by its pid.
import { spawn } from "node:child_process";
import { once } from "node:events";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const ROOT = fileURLToPath(new URL("../../../../", import.meta.url)); // from dist/test/
const HARNESS = join(ROOT, "clients", "typescript", "test", "harness.py");
const PYTHON = join(ROOT, ".venv", "bin", "python");
const STOP_TIMEOUT_MS = 60_000;

export interface Services {
  /** `host:port` of `coordinator`, `inference-0`, `reward` and `trainer`. */
  readonly addresses: Readonly<Record<string, string>>;
  stop(): Promise<void>;
}

export interface Service {
  readonly address: string;
  stop(): Promise<void>;
}

/** The services behind the bearer token `token`, once all are serving. */
export async function startServices(token: string): Promise<Services> {
  const runDir = mkdtempSync(join(tmpdir(), "pipelinerl-ts-"));
  const harness = spawn(PYTHON, [HARNESS, token, runDir], { stdio: ["pipe", "pipe", "pipe"] });
  let log = "";
  harness.stderr.on("data", (chunk: Buffer) => (log = (log + chunk.toString()).slice(-4000)));
  const exited = once(harness, "exit");
  const stop = async () => {
    harness.stdin.end(); // the harness stops the services, each by its own handle, then exits
    const timer = setTimeout(() => harness.kill("SIGTERM"), STOP_TIMEOUT_MS);
    await exited;
    clearTimeout(timer);
    rmSync(runDir, { recursive: true, force: true });
  };
  const line = once(createInterface({ input: harness.stdout }), "line");
  const first = await Promise.race([line, exited.then(([code]) => code as number | null)]);
  if (!Array.isArray(first)) {
    await stop();
    throw new Error(`the harness exited with ${first} before the services were up:\n${log}`);
  }
  return { addresses: JSON.parse(first[0] as string), stop };
}

/** `python -m pipelinerl.<service> --port 0 ...args`, once it has written its address. */
export async function startService(service: string, ...args: string[]): Promise<Service> {
  const dir = mkdtempSync(join(tmpdir(), "pipelinerl-ts-"));
  const ready = join(dir, "address");
  const server = spawn(PYTHON, ["-m", `pipelinerl.${service}`, "--port", "0", "--ready-file", ready, ...args], {
    stdio: "ignore",
  });
  const exited = once(server, "exit");
  const stop = async () => {
    server.kill("SIGTERM"); // it drains and exits
    await exited;
    rmSync(dir, { recursive: true, force: true });
  };
  while (!existsSync(ready)) {
    if (server.exitCode !== null) {
      await stop();
      throw new Error(`${service} exited with ${server.exitCode} before it was serving`);
    }
    await sleep(100);
  }
  return { address: readFileSync(ready, "utf8").trim(), stop };
}
