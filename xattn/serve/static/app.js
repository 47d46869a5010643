// The page of `xattn serve`: plain JS over the server's own API (no build step, nothing fetched from elsewhere).
// Captions and transcripts are one POST each; speech is read from the streamed response and played chunk by chunk
// with Web Audio, so it starts before synthesis ends. Recordings are converted to 16-bit WAV before upload
// (the server reads audio with libsndfile, which reads no webm).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "xattn-api-key";
const RECORD_RATE = 16000; // the recognizer's rate: smaller uploads; the server resamples anything else anyway

// ---- the API --------------------------------------------------------------------------------------------------
const keyField = $("api-key");
keyField.value = sessionStorage.getItem(KEY) || "";
keyField.addEventListener("input", () => {
  const key = keyField.value.trim();
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
});

function auth() {
  const key = keyField.value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// fetch() that throws an Error with one line for a refusal ({"error": {"message"}}) or an unreachable server
async function call(path, options) {
  let response;
  try {
    response = await fetch(path, { ...options, headers: { ...auth(), ...(options.headers || {}) } });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new Error(`cannot reach the server (${error.message})`);
  }
  if (response.ok) return response;
  let message = response.statusText || "refused";
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || body.detail || message;
  } catch (ignored) { /* not JSON: keep the status text */ }
  throw new Error(`${response.status}: ${message}`);
}

function upload(path, file, name, fields) {
  const form = new FormData();
  form.append("file", file, name || file.name || "upload");
  for (const [field, value] of Object.entries(fields || {})) form.append(field, value);
  return call(path, { method: "POST", body: form });
}

// ---- page helpers ---------------------------------------------------------------------------------------------
function showError(section, error) {
  const line = section.querySelector(".error");
  line.textContent = error ? String(error.message || error) : "";
  line.hidden = !error;
  section.dataset.state = error ? "error" : section.dataset.state;
}

function busy(section, on) {
  section.setAttribute("aria-busy", String(on));
  if (on) {
    showError(section, null);
    section.dataset.state = "working";
  }
}

function confidence(element, result) {
  const low = result.low_confidence;
  element.dataset.avgLogprob = String(result.avg_logprob);
  element.textContent = `avg log-prob ${Number(result.avg_logprob)}` +
    (low ? ` · low confidence${result.low_confidence_reason ? `: ${result.low_confidence_reason}` : ""}` : "");
  element.classList.toggle("low", Boolean(low));
}

function show(element, blob) {
  // a file or recording in an <img>/<audio>, the one it showed before released
  if (element.src.startsWith("blob:")) URL.revokeObjectURL(element.src);
  element.src = URL.createObjectURL(blob);
}

function dropZones() {
  for (const zone of document.querySelectorAll("[data-drop]")) {
    const input = $(zone.dataset.drop);
    zone.addEventListener("dragover", (event) => {
      event.preventDefault();
      zone.classList.add("over");
    });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      zone.classList.remove("over");
      if (!event.dataTransfer.files.length) return;
      input.files = event.dataTransfer.files;
      input.dispatchEvent(new Event("change"));
    });
  }
}

// ---- captioning -----------------------------------------------------------------------------------------------
async function caption(file) {
  const section = $("caption");
  const result = section.querySelector(".result");
  const withMap = $("attention-map").checked;
  busy(section, true);
  show($("image-preview"), file);
  $("caption-text").textContent = "…";
  $("caption-confidence").textContent = "";
  $("attention-figure").hidden = true;
  result.hidden = false;
  try {
    const response = await upload("v1/caption", file, file.name, withMap ? { attention_map: "true" } : {});
    const body = await response.json();
    $("caption-text").textContent = body.text;
    confidence($("caption-confidence"), body);
    if (body.attention_map_png) {
      $("attention-image").src = `data:image/png;base64,${body.attention_map_png}`;
      $("attention-figure").hidden = false;
    }
    section.dataset.state = "done";
  } catch (error) {
    $("caption-text").textContent = "";
    showError(section, error);
  } finally {
    busy(section, false);
  }
}

// ---- transcription --------------------------------------------------------------------------------------------
async function transcribe(file, name) {
  const section = $("transcribe");
  busy(section, true);
  show($("audio-preview"), file);
  $("transcript").textContent = "…";
  $("transcript-confidence").textContent = "";
  section.querySelector(".result").hidden = false;
  try {
    const body = await (await upload("v1/audio/transcriptions", file, name)).json();
    $("transcript").textContent = body.text;
    confidence($("transcript-confidence"), body);
    section.dataset.state = "done";
  } catch (error) {
    $("transcript").textContent = "";
    showError(section, error);
  } finally {
    busy(section, false);
  }
}

function wavFile(samples, rate) {
  // float samples [-1, 1] -> a 16-bit mono WAV file
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const text = (offset, s) => [...s].forEach((c, i) => view.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  text(8, "WAVEfmt ");
  view.setUint32(16, 16, true);
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true);
  view.setUint16(32, 2, true);
  view.setUint16(34, 16, true);
  text(36, "data");
  view.setUint32(40, samples.length * 2, true);
  samples.forEach((s, i) => view.setInt16(44 + i * 2, Math.max(-1, Math.min(1, s)) * 0x7fff, true));
  return new Blob([view.buffer], { type: "audio/wav" });
}

async function toWav(blob) {
  // whatever MediaRecorder made (webm or ogg opus) -> mono 16-bit WAV at RECORD_RATE; decoding resamples to the
  // decoding context's rate, rendering through a one-channel context mixes the channels down
  const decoded = await new OfflineAudioContext(1, 1, RECORD_RATE).decodeAudioData(await blob.arrayBuffer());
  const mixer = new OfflineAudioContext(1, decoded.length, RECORD_RATE);
  const source = mixer.createBufferSource();
  source.buffer = decoded;
  source.connect(mixer.destination);
  source.start();
  return wavFile((await mixer.startRendering()).getChannelData(0), RECORD_RATE);
}

let recorder = null;

async function record() {
  const section = $("transcribe");
  const button = $("record");
  const status = $("record-status");
  if (recorder && recorder.state === "recording") {
    recorder.stop();
    return;
  }
  showError(section, null);
  if (!navigator.mediaDevices || !window.MediaRecorder) {
    showError(section, "recording needs a browser with MediaRecorder, on https or localhost");
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (error) {
    showError(section, `no microphone: ${error.message}`);
    return;
  }
  const parts = [];
  const started = performance.now();
  const clock = setInterval(() => {
    status.textContent = `recording… ${Math.round((performance.now() - started) / 1000)} s`;
  }, 250);
  recorder = new MediaRecorder(stream);
  recorder.addEventListener("dataavailable", (event) => parts.push(event.data));
  recorder.addEventListener("stop", async () => {
    clearInterval(clock);
    stream.getTracks().forEach((track) => track.stop());
    button.textContent = "Record";
    button.setAttribute("aria-pressed", "false");
    status.textContent = "";
    try {
      const wav = await toWav(new Blob(parts, { type: recorder.mimeType }));
      section.dataset.upload = wav.type;
      await transcribe(wav, "recording.wav");
    } catch (error) {
      showError(section, `could not read the recording: ${error.message}`);
    }
  });
  recorder.start();
  section.dataset.state = "recording";
  button.textContent = "Stop recording";
  button.setAttribute("aria-pressed", "true");
}

// ---- speech ---------------------------------------------------------------------------------------------------
// A streamed WAV: a 44-byte header (16-bit mono PCM, the rate), then samples as they are made. Each piece read
// from the response is scheduled right after the previous one on an AudioContext, so playback starts with the
// first piece. For the record (and the test), the section's data attributes say when the first sound was due,
// when the response ended, and how much audio had played by then, all in ms from the click.
let player = null;

async function speak(event) {
  event.preventDefault();
  const section = $("speak");
  const status = $("speech-status");
  const audio = $("speech-audio");
  stopSpeaking(); // the one before, if any
  const context = new AudioContext(); // created on the click, so the browser lets it play
  const abort = new AbortController();
  player = { context, abort };
  const current = () => player.abort === abort;
  const clicked = performance.now();
  const ms = (t) => String(Math.round(t - clicked));
  for (const name of ["firstSoundMs", "responseEndMs", "playedAtEndMs", "samples"]) delete section.dataset[name];
  busy(section, true);
  $("speak-stop").disabled = false;
  audio.hidden = true;
  audio.pause();
  section.querySelector(".result").hidden = false;
  status.textContent = "Synthesizing…";
  const pieces = [];
  let rate = 0;
  let pending = new Uint8Array(0); // bytes not yet played: the header, an odd byte
  let next = 0; // context time where the next piece starts
  let first = null; // context time of the first sound
  let total = 0;
  try {
    await context.resume();
    const body = { input: $("speak-text").value, response_format: "wav" };
    if ($("voice").value) body.voice = $("voice").value;
    const response = await call("v1/audio/speech", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: abort.signal,
    });
    const reader = response.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      const bytes = new Uint8Array(pending.length + value.length);
      bytes.set(pending);
      bytes.set(value, pending.length);
      let start = 0;
      if (!rate) {
        if (bytes.length < 44) {
          pending = bytes;
          continue;
        }
        rate = wavRate(bytes);
        start = 44;
      }
      const whole = start + Math.floor((bytes.length - start) / 2) * 2;
      pending = bytes.slice(whole);
      if (whole === start) continue;
      const view = new DataView(bytes.buffer, start, whole - start);
      const floats = new Float32Array(view.byteLength / 2);
      for (let i = 0; i < floats.length; i++) floats[i] = view.getInt16(i * 2, true) / 32768;
      pieces.push(floats);
      total += floats.length;
      const buffer = context.createBuffer(1, floats.length, rate);
      buffer.copyToChannel(floats, 0);
      const source = context.createBufferSource();
      source.buffer = buffer;
      source.connect(context.destination);
      next = Math.max(next, context.currentTime + 0.05); // a gap only when the network fell behind
      if (first === null) {
        first = next;
        section.dataset.firstSoundMs = ms(performance.now() + (first - context.currentTime) * 1000);
        section.dataset.state = "playing";
        status.textContent = "Playing while the rest is synthesized…";
      }
      source.start(next);
      next += buffer.duration;
    }
    if (first === null) throw new Error("the server sent no audio");
    const played = Math.max(0, context.currentTime - first);
    section.dataset.responseEndMs = ms(performance.now());
    section.dataset.playedAtEndMs = String(Math.round(played * 1000));
    section.dataset.samples = String(total);
    status.textContent = `${(total / rate).toFixed(1)} s of audio; the first sound came ` +
      `${(section.dataset.firstSoundMs / 1000).toFixed(1)} s after the click, ${played.toFixed(1)} s had ` +
      "played when synthesis ended";
    const all = new Float32Array(total);
    pieces.reduce((at, piece) => (all.set(piece, at), at + piece.length), 0);
    show(audio, wavFile(all, rate)); // to replay or save
    audio.hidden = false;
    section.dataset.state = "done";
    // the rest plays on; then the context closes (Stop still stops it until then)
    setTimeout(() => {
      context.close().catch(() => {});
      if (current()) $("speak-stop").disabled = true;
    }, Math.max(0, next - context.currentTime) * 1000 + 200);
  } catch (error) {
    context.close().catch(() => {});
    if (!current()) return; // a newer Speak took over the section
    $("speak-stop").disabled = true;
    status.textContent = error.name === "AbortError" ? "Stopped." : "";
    if (error.name !== "AbortError") showError(section, error);
    else section.dataset.state = "stopped";
  } finally {
    if (current()) busy(section, false);
  }
}

function wavRate(header) {
  const view = new DataView(header.buffer, 0, 44);
  const tag = (offset) => String.fromCharCode(...header.slice(offset, offset + 4));
  if (tag(0) !== "RIFF" || tag(8) !== "WAVE" || view.getUint16(22, true) !== 1 || view.getUint16(34, true) !== 16) {
    throw new Error("the server's audio is not 16-bit mono WAV");
  }
  return view.getUint32(24, true);
}

function stopSpeaking() {
  if (!player) return;
  player.abort.abort(); // the server stops synthesizing when its listener leaves
  player.context.close().catch(() => {});
  $("speak-stop").disabled = true;
}

// ---- start ----------------------------------------------------------------------------------------------------
async function served() {
  // which tasks this server runs (/health needs no key): the others are hidden
  try {
    const health = await (await fetch("health")).json();
    const names = { caption: "captions", transcribe: "transcribes", speech: "speaks" };
    const tasks = Object.keys(health.models);
    $("served").textContent = `This server ${tasks.map((t) => names[t]).join(", ") || "runs no model"}` +
      ` (xattn ${health.version}).`;
    $("caption").hidden = !tasks.includes("caption");
    $("transcribe").hidden = !tasks.includes("transcribe");
    $("speak").hidden = !tasks.includes("speech");
    const voices = health.voices || [];
    if (voices.length > 1) {
      $("voice").replaceChildren(...voices.map((v) => new Option(v, v)));
      $("voice").hidden = false;
      document.querySelector("label[for=voice]").hidden = false;
    }
  } catch (error) {
    $("served").textContent = `The server does not answer /health (${error.message}).`;
  }
  document.body.dataset.ready = "true";
}

dropZones();
$("image-file").addEventListener("change", (e) => e.target.files[0] && caption(e.target.files[0]));
$("audio-file").addEventListener("change", (e) => e.target.files[0] && transcribe(e.target.files[0]));
$("record").addEventListener("click", record);
$("speak-form").addEventListener("submit", speak);
$("speak-stop").addEventListener("click", stopSpeaking);
for (const form of document.querySelectorAll("#caption form, #transcribe form")) {
  form.addEventListener("submit", (e) => e.preventDefault());
}
served();
