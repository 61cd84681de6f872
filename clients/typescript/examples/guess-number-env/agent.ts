// The game played by an agent that runs its own loop (server.ts --agent): RunEpisode's whole episode,
// every model call made with the official `openai` npm package against the episode's base_url,
// which records its tokens for training.
//
//   opening ──► chat.completions.create(messages) ──► the answer appended as returned
//           ──► game step ──► its reply appended ──► ... until the game ends
//   return the summed rewards (truncated when a turn was cut by max_tokens, or at the turn limit)
import { create } from "@bufbuild/protobuf";
import OpenAI from "openai";
import type { ChatCompletionMessageParam } from "openai/resources/chat/completions";
import {
  MessageSchema,
  Role,
  RunEpisodeResponseSchema,
  type Message,
  type RunEpisodeRequest,
  type RunEpisodeResponse,
} from "../../src/gen/pipelinerl/environment/v1/environment_pb.js";
import type { Game } from "./episodes.js";

const ROLES: Partial<Record<Role, "system" | "user">> = { [Role.SYSTEM]: "system", [Role.USER]: "user" };

function toOpenAI(message: Message): ChatCompletionMessageParam {
  const role = ROLES[message.role];
  if (role === undefined) {
    throw new Error(`the game wrote a ${Role[message.role]} message; an agent's game writes system and user`);
  }
  return { role, content: message.content };
}

/** Plays one episode of `game` through the API at `request.baseUrl`; `signal` ends it early. */
export async function playEpisode(game: Game, request: RunEpisodeRequest, signal: AbortSignal): Promise<RunEpisodeResponse> {
  const instance = game.start(request.seed, request.task);
  const client = new OpenAI({ baseURL: request.baseUrl, apiKey: request.apiKey });
  const messages = instance.opening.messages.map(toOpenAI);
  const maxTurns = instance.opening.maxTurns;
  const rewards: Record<string, number> = {};
  const done = (truncated: boolean) =>
    create(RunEpisodeResponseSchema, {
      rewards: Object.entries(rewards).map(([name, value]) => ({ name, value })),
      truncated,
    });
  for (let turn = 1; ; turn++) {
    const reply = await client.chat.completions.create({ model: request.model, messages }, { signal });
    const choice = reply.choices[0];
    if (choice === undefined || choice.finish_reason === "length") {
      return done(true); // cut by max_tokens: the game is not played on
    }
    const content = choice.message.content ?? "";
    messages.push({ role: "assistant", content });
    const step = instance.step(create(MessageSchema, { role: Role.ASSISTANT, content }));
    for (const [name, value] of Object.entries(step.rewards ?? {})) {
      rewards[name] = (rewards[name] ?? 0) + value;
    }
    if (step.terminated || step.truncated) {
      return done(Boolean(step.truncated) && !step.terminated);
    }
    if (maxTurns > 0 && turn >= maxTurns) {
      return done(true);
    }
    messages.push(...step.messages.map(toOpenAI));
  }
}
