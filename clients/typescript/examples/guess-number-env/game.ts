// guess_number, the game of the Python `builtin:guess_number`: find a secret number from
// higher/lower replies.
//
//   user: guess 1 to 16        assistant: 8
//   user: higher               assistant: 12
//   user: lower                assistant: 10     (right: the episode terminates, correct 1)
//
// The secret is drawn from the episode's seed (splitmix64, not Python's random.Random, so a seed
// gives another secret than the Python server's) or is the task (digits); a reply without a number
// is answered `a number`. A wrong guess at the last turn truncates the episode with correct 0.
import type { Message } from "../../src/gen/pipelinerl/environment/v1/environment_pb.js";
import { invalidArgument, user, type Game, type Instance, type Step } from "./episodes.js";

const NUMBER = /-?[0-9]+/;
const MASK = (1n << 64n) - 1n;

/** splitmix64 of `seed`: the same secret for the same seed, whatever the process. */
export function mix(seed: bigint): bigint {
  let z = (seed + 0x9e3779b97f4a7c15n) & MASK;
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & MASK;
  return z ^ (z >> 31n);
}

export interface GuessNumberOptions {
  readonly low: number;
  readonly high: number;
  readonly turns: number;
}

export function guessNumber({ low, high, turns }: GuessNumberOptions): Game {
  if (!(Number.isSafeInteger(low) && Number.isSafeInteger(high) && low <= high)) {
    throw new Error(`low ${low} and high ${high} must be integers, low at most high`);
  }
  if (!(Number.isSafeInteger(turns) && turns >= 1)) {
    throw new Error("turns must be 1 or more");
  }
  return {
    name: "guess_number",
    version: "1-typescript",
    description: "guess a secret number from higher/lower replies",
    tools: [],
    maxTurns: turns,
    start(seed: bigint, task: string): Instance {
      let secret: bigint;
      if (task) {
        if (!/^[0-9]+$/.test(task) || BigInt(task) < BigInt(low) || BigInt(task) > BigInt(high)) {
          throw invalidArgument("task", `'${task}' is no number from ${low} to ${high}`);
        }
        secret = BigInt(task);
      } else {
        secret = BigInt(low) + (mix(seed) % BigInt(high - low + 1));
      }
      let turn = 0;
      return {
        opening: { messages: [user(`guess ${low} to ${high}`)], maxTurns: turns },
        step(action: Message): Step {
          turn += 1;
          const found = NUMBER.exec(action.content);
          const guess = found === null ? undefined : BigInt(found[0]);
          if (guess === secret) {
            return { messages: [], rewards: { correct: 1 }, terminated: true };
          }
          const reply = guess === undefined ? "a number" : guess < secret ? "higher" : "lower";
          if (turn >= turns) {
            return { messages: [user(reply)], rewards: { correct: 0 }, truncated: true };
          }
          return { messages: [user(reply)] };
        },
      };
    },
  };
}
