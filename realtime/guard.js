// Loaded into soketi with `node --require` (`coderunner up`, the test stacks) or NODE_OPTIONS
// (the compose file), for what one client must not be able to do to the others:
//
// - soketi 1.6.1 reads what a client sends without checking its shape. A `pusher:subscribe`
//   or `pusher:unsubscribe` without `data`, or naming a channel that is not a string, throws
//   in its message handler, and soketi stops on the uncaught exception: one message from
//   anyone who knows the public app key ended every follower's connection (and `coderunner
//   up` with it). Such a message is refused here with a `pusher:error` (4300).
// - It accepts client messages of up to 100 MiB, where a subscription takes a few hundred
//   bytes (client events are off): MAX_CLIENT_MESSAGE_BYTES.
// - A subscriber that stops reading kept up to 1 MiB of unsent events each for as long as it
//   stayed, with nothing else dropped or told; a few dozen such sockets held a hundred MB and
//   slowed every other follower. Its connection is now closed once that much waits (uWS's
//   closeOnBackpressureLimit); a client that reconnects reads what it missed from the log.
// - Its Redis adapter's clients wait for Redis rather than give a command up
//   (SOKETI_ADAPTER_REDIS_*_OPTIONS), and soketi's stop waits on them: it evicts every
//   socket (each unsubscribe asks Redis how many listeners are left) and then QUITs. With
//   Redis gone or frozen it never ended, and `coderunner up` SIGKILLed it 15 s later. Its
//   stop now ends STOP_BOUND_MS after its grace at the latest: soketi keeps nothing that
//   a cut stop could lose (clients are told to reconnect before anything waits on Redis).
//
// soketi is not patched on disk (the compose file runs its published image): this wraps what
// soketi's modules export as it loads them.
"use strict";

const Module = require("module");

const MAX_CLIENT_MESSAGE_BYTES = 64 * 1024;
const STOP_BOUND_MS = 2000;
const MAX_TIMER_MS = 2 ** 31 - 1; // (setTimeout fires at once past this)

const STRING_FIELDS = {
  "pusher:subscribe": { required: ["channel"], optional: ["auth", "channel_data"] },
  "pusher:unsubscribe": { required: ["channel"], optional: [] },
  "pusher:signin": { required: ["auth", "user_data"], optional: [] },
};

function isObject(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

// Why `message` is refused, or "" when soketi may read it.
function fault(message) {
  if (!isObject(message)) return "a message must be a JSON object";
  if (typeof message.event !== "string") return "`event` must be a string";
  const shape = STRING_FIELDS[message.event];
  if (shape !== undefined) {
    if (!isObject(message.data)) return `${message.event} needs \`data\`, an object`;
    for (const name of shape.required) {
      if (typeof message.data[name] !== "string" || message.data[name] === "") {
        return `${message.event} needs \`data.${name}\`, a string`;
      }
    }
    for (const name of shape.optional) {
      if (message.data[name] !== undefined && typeof message.data[name] !== "string") {
        return `\`data.${name}\` must be a string`;
      }
    }
  } else if (message.event.startsWith("client-") && typeof message.channel !== "string") {
    return "a client event needs `channel`, a string";
  }
  return "";
}

function guard(WsHandler) {
  const onMessage = WsHandler.prototype.onMessage;
  WsHandler.prototype.onMessage = function guardedOnMessage(ws, message, isBinary) {
    if (message instanceof ArrayBuffer) {
      try {
        message = JSON.parse(Buffer.from(message).toString("utf8"));
      } catch (err) {
        return; // (what soketi itself does with a message that is not JSON)
      }
    }
    const why = fault(message);
    if (why !== "") {
      if (typeof ws.sendJson === "function") {
        // 4300-4399: an error that keeps the connection (Pusher's protocol).
        ws.sendJson({ event: "pusher:error", data: { code: 4300, message: `Refused: ${why}` } });
      }
      return;
    }
    return onMessage.call(this, ws, message, isBinary);
  };
}

function bound(Server) {
  const configure = Server.prototype.configureWebsockets;
  Server.prototype.configureWebsockets = function boundedWebsockets(app) {
    const ws = app.ws;
    app.ws = function boundedWs(pattern, behavior) {
      return ws.call(this, pattern, {
        ...behavior,
        maxPayloadLength: Math.min(behavior.maxPayloadLength || Infinity, MAX_CLIENT_MESSAGE_BYTES),
        closeOnBackpressureLimit: true,
      });
    };
    return configure.call(this, app);
  };
}

// Whatever began the stop (a signal, or soketi's own handler of an uncaught exception),
// the process ends STOP_BOUND_MS after soketi's shutdown grace.
function stopWithin(Server) {
  const stop = Server.prototype.stop;
  if (typeof stop !== "function") return;
  Server.prototype.stop = function boundedStop() {
    if (!this.coderunnerStopBound) {
      this.coderunnerStopBound = true;
      const graceMs = Math.min(Math.max(Number(this.options.shutdownGracePeriod) || 0, 0), MAX_TIMER_MS - STOP_BOUND_MS);
      const timer = setTimeout(() => {
        console.error(`soketi had not stopped ${graceMs + STOP_BOUND_MS} ms after its stop began (Redis away?): exiting`);
        process.exit(0);
      }, graceMs + STOP_BOUND_MS);
      timer.unref();
    }
    return stop.apply(this, arguments);
  };
}

const load = Module._load;
Module._load = function loadGuarded(request, parent, isMain) {
  const exported = load.apply(this, arguments);
  if (exported && typeof exported.WsHandler === "function" && !exported.WsHandler.coderunnerGuarded) {
    guard(exported.WsHandler);
    exported.WsHandler.coderunnerGuarded = true;
  }
  if (
    exported &&
    typeof exported.Server === "function" &&
    typeof exported.Server.prototype.configureWebsockets === "function" &&
    !exported.Server.coderunnerGuarded
  ) {
    bound(exported.Server);
    stopWithin(exported.Server);
    exported.Server.coderunnerGuarded = true;
  }
  return exported;
};
