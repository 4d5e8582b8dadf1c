// A multi-turn tool loop over WebSocket mode with the openai Node SDK's ResponsesWS, as a
// Node application would write it: one socket, each turn sends only its new items with
// previous_response_id, tool calls run locally and their outputs go back on the same socket.
// Usage: node responses_ws_loop.mjs <base_url (ending in /v1)> <api_key> <rounds>
// Prints one JSON object: every response's events and final state, and the errors seen.
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/responses/ws';

const [baseURL, apiKey, roundsArg] = process.argv.slice(2);
const rounds = Number(roundsArg ?? 3);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60_000 });

const tools = [{
  type: 'function', name: 'get_weather', description: 'Weather for a city', strict: false,
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
}];
const runTool = (call) => `${JSON.parse(call.arguments).city}: sunny, 21 C`;

const ws = new ResponsesWS(client);
const errors = [];
const waiters = [];
let current = null;
ws.on('event', (event) => {
  if (current) current.events.push(event.type);
  if (['response.completed', 'response.incomplete', 'response.failed'].includes(event.type)) {
    current.final = event.response;
    const done = current;
    current = null;
    waiters.shift()(done);
  }
});
ws.on('error', (err) => {
  errors.push({ message: err.message, code: err.error?.error?.code ?? null, status: err.error?.status ?? null });
  if (current && waiters.length) {
    const done = current;
    current = null;
    waiters.shift()(done);
  }
});

function create(body) {
  return new Promise((resolve) => {
    current = { request: body, events: [] };
    waiters.push(resolve);
    ws.send({ type: 'response.create', model: 'loopserve-tiny', tools, store: false, ...body });
  });
}

const timer = setTimeout(() => { console.error('timed out'); process.exit(3); }, 120_000);
await new Promise((resolve, reject) => { ws.socket.on('open', resolve); ws.socket.on('error', reject); });
const turns = [];
let previous = null;
for (let round = 0; round < rounds; round++) {
  const ask = await create({ input: `Round ${round}: what is the weather in Paris?`, previous_response_id: previous ?? undefined });
  turns.push(ask);
  const calls = (ask.final?.output ?? []).filter((item) => item.type === 'function_call');
  const answer = await create({
    previous_response_id: ask.final.id,
    input: calls.map((call) => ({ type: 'function_call_output', call_id: call.call_id, output: runTool(call) })),
  });
  turns.push(answer);
  previous = answer.final.id;
  if (round === 0) {
    // Bad input mid-loop: an unknown previous_response_id gets an error event, and the
    // socket keeps serving the loop.
    turns.push(await create({ input: 'hello', previous_response_id: 'resp_does_not_exist' }));
  }
}
clearTimeout(timer);
ws.close({ code: 1000, reason: 'done' });
console.log(JSON.stringify({ turns, errors }));
