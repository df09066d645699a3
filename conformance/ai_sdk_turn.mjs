// One turn of the Vercel AI SDK (`ai`, with @ai-sdk/openai-compatible), streamed, run by
// conformance/clients.py from a copy in conformance/.cache/npm (where its imports resolve):
//
//     node ai_sdk_turn.mjs BASE_URL STATE_FILE PROMPT
//
// It reads the conversation so far from STATE_FILE (absent on the first turn), sends
// PROMPT as the next user turn, prints the reply and writes the conversation back.
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { streamText } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";

const [url, stateFile, prompt] = process.argv.slice(2);
const provider = createOpenAICompatible({ name: "mlxs", baseURL: `${url}/v1`, apiKey: "sk-unused" });
const messages = existsSync(stateFile) ? JSON.parse(readFileSync(stateFile, "utf8")) : [];
messages.push({ role: "user", content: prompt });
let failure = null;
const result = streamText({
  model: provider("mlx-stream/agents"), messages, maxOutputTokens: 64, maxRetries: 0,
  abortSignal: AbortSignal.timeout(120_000), onError: ({ error }) => { failure = error; },
});
const text = await result.text.catch((error) => { failure ??= error; });
if (failure) {
  console.error(`${failure.name}: ${String(failure.message).replace(/\s+/g, " ")}`);
  process.exit(1);
}
messages.push({ role: "assistant", content: text });
writeFileSync(stateFile, JSON.stringify(messages));
console.log(text);
