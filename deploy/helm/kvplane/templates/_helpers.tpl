{{/* Names and labels. */}}
{{- define "kvplane.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvplane.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvplane.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Redis URL the routers share, or "" for the in-memory index. */}}
{{- define "kvplane.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if .Values.redis.bundled.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "kvplane.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The model name clients send and agents register. */}}
{{- define "kvplane.servedModelName" -}}
{{- if .Values.engines.servedModelName -}}
{{- .Values.engines.servedModelName -}}
{{- else if eq .Values.engines.kind "engine-sim" -}}
kvplane-tiny
{{- else -}}
{{- .Values.engines.model -}}
{{- end -}}
{{- end -}}

{{/* Refusals: configurations that would render but not work. */}}
{{- define "kvplane.checks" -}}
{{- $routers := int .Values.router.replicas -}}
{{- if .Values.router.autoscaling.enabled -}}
{{- $routers = int .Values.router.autoscaling.maxReplicas -}}
{{- end -}}
{{- $picker := .Values.picker -}}
{{- if $picker.enabled -}}
{{- if and (gt $routers 1) (not (include "kvplane.redisUrl" .)) -}}
{{- fail "picker mode with more than one router replica needs the Redis index: every replica serves the picker (active-active) and must see the same index; set redis.url or redis.bundled.enabled" -}}
{{- end -}}
{{- if and (not .Values.engines.enabled) (not $picker.inferencePool.selector) -}}
{{- fail "picker.inferencePool.selector must give your engine pods' labels when engines.enabled is false (the InferencePool selects them)" -}}
{{- end -}}
{{- if and $picker.tls.enabled (not $picker.tls.secretName) (not .Values.controlPlaneTls.enabled) -}}
{{- fail "picker.tls.enabled needs picker.tls.secretName, or controlPlaneTls.enabled for the router's own certificate" -}}
{{- end -}}
{{- if has (int $picker.port) (list (int .Values.router.httpPort) (int .Values.router.adminPort) (int .Values.router.grpcPort)) -}}
{{- fail "picker.port must differ from router.httpPort, adminPort and grpcPort" -}}
{{- end -}}
{{- if and $picker.httpRoute.enabled (not $picker.httpRoute.parentRefs) -}}
{{- fail "picker.httpRoute.enabled needs picker.httpRoute.parentRefs: the Gateway(s) the route attaches to" -}}
{{- end -}}
{{- end -}}
{{- if and (gt $routers 1) (not (include "kvplane.redisUrl" .)) -}}
{{- fail "more than one router replica needs a shared index: set redis.url or redis.bundled.enabled (without one each replica would keep a private index)" -}}
{{- end -}}
{{- if and .Values.redis.url .Values.redis.bundled.enabled -}}
{{- fail "set either redis.url or redis.bundled.enabled, not both" -}}
{{- end -}}
{{- if and .Values.engines.enabled (eq .Values.engines.kind "vllm") (not .Values.engines.model) -}}
{{- fail "engines.kind vllm needs engines.model" -}}
{{- end -}}
{{- if ne (mod (int .Values.router.blockSize) (int .Values.engines.blockSize)) 0 -}}
{{- fail "engines.blockSize must divide router.blockSize" -}}
{{- end -}}
{{- end -}}

{{/* The agent container, beside an engine reached on localhost. */}}
{{- define "kvplane.agentContainer" -}}
- name: kvplane-agent
  image: {{ include "kvplane.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - agent
    - --engine={{ if eq .Values.engines.kind "engine-sim" }}vllm{{ else }}{{ .Values.engines.kind }}{{ end }}
    - --engine-url=http://127.0.0.1:{{ .Values.engines.httpPort }}
    - --kv-events-endpoint={{ include "kvplane.kvEvents" (dict "root" . "side" "agent" "port" .Values.engines.kvEventsPort "name" "kv-events") }}
    - --kv-events-replay-endpoint={{ include "kvplane.kvEvents" (dict "root" . "side" "agent" "port" .Values.engines.kvReplayPort "name" "kv-replay") }}
    - --kv-events-topic={{ .Values.engines.kvEventsTopic }}
    - --control-plane-address={{ include "kvplane.fullname" . }}-router:{{ .Values.router.grpcPort }}
    - --block-size={{ .Values.router.blockSize }}
    - --load-interval-s={{ .Values.engines.agent.loadIntervalSeconds }}
    {{- with .Values.engines.agent.labels }}
    - --labels={{ toJson . }}
    {{- end }}
  env:
    - name: KVPLANE_AGENT__WORKER_ID
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: KVPLANE_AGENT__ADVERTISE_URL
      value: "http://$(POD_IP):{{ .Values.engines.httpPort }}"
    - name: KVPLANE_LOGGING__FORMAT
      value: {{ .Values.router.logFormat | quote }}
    {{- if .Values.router.workerCredentials }}
    - name: KVPLANE_CONTROL_PLANE__AGENT_TOKEN_FILE
      value: /var/run/kvplane/agent-token
    {{- else }}
    {{- with .Values.router.secrets.agentToken.name }}
    - name: KVPLANE_CONTROL_PLANE__AGENT_TOKEN
      valueFrom: {secretKeyRef: {name: {{ . }}, key: {{ $.Values.router.secrets.agentToken.key }}}}
    {{- end }}
    {{- end }}
    {{- if .Values.controlPlaneTls.enabled }}
    - name: KVPLANE_AGENT__TLS_CA_FILE
      value: /etc/kvplane/control-plane-ca/ca.crt
    {{- end }}
  resources: {{- toYaml .Values.engines.agent.resources | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 10001
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  {{- if or .Values.router.workerCredentials .Values.controlPlaneTls.enabled (eq .Values.engines.kvEventsTransport "ipc") }}
  volumeMounts:
    {{- if eq .Values.engines.kvEventsTransport "ipc" }}
    - {name: kv-events, mountPath: /run/kvplane-events}
    {{- end }}
    {{- if .Values.router.workerCredentials }}
    - {name: agent-token, mountPath: /var/run/kvplane, readOnly: true}
    {{- end }}
    {{- if .Values.controlPlaneTls.enabled }}
    - {name: control-plane-ca, mountPath: /etc/kvplane/control-plane-ca, readOnly: true}
    {{- end }}
  {{- end }}
{{- end -}}

{{/* Secrets the chart generates when no name is given: a value read back from the
Secret already installed (upgrades keep it), else a new random one; base64. */}}
{{- define "kvplane.generatedValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- index $existing.data .key -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}

{{- define "kvplane.workerCredentialSecret" -}}
{{- $ref := .Values.router.secrets.workerCredentialSecret -}}
{{- dict "name" (default (printf "%s-worker-credentials" (include "kvplane.fullname" .)) $ref.name) "key" $ref.key | toJson -}}
{{- end -}}

{{- define "kvplane.redisPasswordSecret" -}}
{{- $ref := .Values.redis.bundled.passwordSecret -}}
{{- dict "name" (default (printf "%s-redis" (include "kvplane.fullname" .)) $ref.name) "key" $ref.key | toJson -}}
{{- end -}}

{{- define "kvplane.tlsSecretName" -}}
{{- printf "%s-router-tls" (include "kvplane.fullname" .) -}}
{{- end -}}

{{/* The names agents reach the router's gRPC port by: its certificate's. In picker mode
the picker's Service's names too (the picker serves the same certificate by default). */}}
{{- define "kvplane.routerDnsNames" -}}
{{- $services := list (printf "%s-router" (include "kvplane.fullname" .)) -}}
{{- if .Values.picker.enabled -}}
{{- $services = append $services (include "kvplane.pickerService" .) -}}
{{- end -}}
{{- $names := list -}}
{{- range $services -}}
{{- $names = concat $names (list . (printf "%s.%s" . $.Release.Namespace) (printf "%s.%s.svc" . $.Release.Namespace) (printf "%s.%s.svc.cluster.local" . $.Release.Namespace)) -}}
{{- end -}}
{{- $names | toJson -}}
{{- end -}}

{{/* Picker mode's names: the picker's Service (the InferencePool's endpointPickerRef) and
the InferencePool (an HTTPRoute's backendRef). */}}
{{- define "kvplane.pickerService" -}}
{{- printf "%s-picker" (include "kvplane.fullname" .) -}}
{{- end -}}

{{- define "kvplane.inferencePool" -}}
{{- printf "%s-pool" (include "kvplane.fullname" .) -}}
{{- end -}}

{{/* The picker's TLS pair, as the router reads it: the mounted Secret's files. */}}
{{- define "kvplane.pickerTlsDir" -}}
{{- if .Values.picker.tls.secretName -}}
/etc/kvplane/picker-tls
{{- else -}}
/etc/kvplane/tls
{{- end -}}
{{- end -}}

{{/* The init container that derives this pod's own agent token (worker credentials):
the secret reaches it alone, the agent reads the token from a memory-backed volume. */}}
{{- define "kvplane.workerTokenInit" -}}
{{- $secret := include "kvplane.workerCredentialSecret" . | fromJson -}}
- name: kvplane-worker-token
  image: {{ include "kvplane.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: [worker-token, --worker-id, $(POD_NAME), --output, /var/run/kvplane/agent-token]
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: KVPLANE_CONTROL_PLANE__WORKER_CREDENTIAL_SECRET
      valueFrom: {secretKeyRef: {name: {{ $secret.name }}, key: {{ $secret.key }}}}
  resources:
    requests: {cpu: 10m, memory: 64Mi}
    limits: {cpu: 500m, memory: 256Mi}
  securityContext:
    runAsNonRoot: true
    runAsUser: 10001
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  volumeMounts:
    - {name: agent-token, mountPath: /var/run/kvplane}
{{- end -}}

{{/* Volumes the agent container needs: its token, the router's CA. */}}
{{- define "kvplane.agentVolumes" -}}
{{- if eq .Values.engines.kvEventsTransport "ipc" }}
- name: kv-events
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
{{- end }}
{{- if .Values.router.workerCredentials }}
- name: agent-token
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
{{- end }}
{{- if .Values.controlPlaneTls.enabled }}
- name: control-plane-ca
  secret:
    secretName: {{ include "kvplane.tlsSecretName" . }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- end -}}

{{/* A KV event socket: a file in the shared kv-events volume (ipc), or a port the engine
binds on every interface and the agent reaches on localhost (tcp). */}}
{{- define "kvplane.kvEvents" -}}
{{- if eq .root.Values.engines.kvEventsTransport "ipc" -}}
ipc:///run/kvplane-events/{{ .name }}
{{- else if eq .side "engine" -}}
tcp://*:{{ .port }}
{{- else -}}
tcp://127.0.0.1:{{ .port }}
{{- end -}}
{{- end -}}
