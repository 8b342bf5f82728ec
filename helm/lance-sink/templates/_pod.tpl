{{/*
The writers' pod template (`lance-sink run`), shared by the Deployment (storage.mode
objectStore) and the StatefulSet (storage.mode localVolume).
*/}}
{{- define "lance-sink.podTemplate" -}}
{{- include "lance-sink.pod" (dict "root" . "serve" false) -}}
{{- end -}}

{{/* The query-only pods' template (`lance-sink serve`, serve.enabled): serve.yaml. */}}
{{- define "lance-sink.serve.podTemplate" -}}
{{- include "lance-sink.pod" (dict "root" . "serve" true) -}}
{{- end -}}

{{/*
One pod template for both tiers: (dict "root" $ "serve" bool). Secrets reach the sink as
LANCE_SINK__... environment variables (the loader ranks the environment above sink.toml);
nothing secret is in the ConfigMap. What differs for the serve tier: its labels (disjoint from
the writers' selector), the command, its resources, no advertised query URL (it claims no shard)
and no data volume (storage.mode localVolume refuses serve.enabled).
*/}}
{{- define "lance-sink.pod" -}}
{{- $root := .root -}}
{{- $serve := .serve -}}
{{- $selectorLabels := include "lance-sink.selectorLabels" $root -}}
{{- if $serve -}}
{{- $selectorLabels = include "lance-sink.serve.selectorLabels" $root -}}
{{- end -}}
{{- with $root -}}
{{- $c := .Values.config -}}
{{- $s := .Values.secrets -}}
metadata:
  labels:
    {{- $selectorLabels | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    # Roll the pods when the rendered sink.toml changes.
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") . | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "lance-sink.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
  {{- if $serve }}
  # The writers' grace period: SIGTERM stops the query servers (queries in flight get up to
  # config.query.timeout_ms) and the process exits 0; it has nothing to drain.
  {{- else }}
  # Longer than config.shutdown.drain_deadline_s: SIGTERM starts the drain (stop fetching,
  # finish in-flight WAL appends, commit, close); SIGKILL only comes after the grace period.
  {{- end }}
  terminationGracePeriodSeconds: {{ include "lance-sink.gracePeriod" . }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ .Values.podSecurityContext.runAsUser }}
    runAsGroup: {{ .Values.podSecurityContext.runAsGroup }}
    fsGroup: {{ .Values.podSecurityContext.fsGroup }}
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: lance-sink
      image: {{ include "lance-sink.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args: [{{ ternary "serve" "run" $serve | quote }}, "--config", "{{ include "lance-sink.configDir" . }}/sink.toml"]
      securityContext:
        runAsNonRoot: true
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
      ports:
        - name: metrics
          containerPort: {{ $c.observability.metrics_port }}
          protocol: TCP
        {{- if or $serve $c.query.enabled }}
        - name: query
          containerPort: {{ $c.query.port }}
          protocol: TCP
        {{- end }}
      {{- with include (ternary "lance-sink.serve.env" "lance-sink.env" $serve) . | trim }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      startupProbe:
        httpGet:
          path: /healthz
          port: metrics
        periodSeconds: {{ .Values.probes.startup.periodSeconds }}
        timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
        failureThreshold: {{ .Values.probes.startup.failureThreshold }}
      livenessProbe:
        httpGet:
          path: /healthz
          port: metrics
        initialDelaySeconds: {{ .Values.probes.liveness.initialDelaySeconds }}
        periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
        timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
        failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: metrics
        initialDelaySeconds: {{ .Values.probes.readiness.initialDelaySeconds }}
        periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
        timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
        failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
      {{- if $serve }}
      resources:
        requests:
          {{- with .Values.serve.resources.requests.cpu }}
          cpu: {{ . | quote }}
          {{- end }}
          memory: {{ default (include "lance-sink.serve.memoryLimit" .) .Values.serve.resources.requests.memory | quote }}
        limits:
          {{- with .Values.serve.resources.limits.cpu }}
          cpu: {{ . | quote }}
          {{- end }}
          # Derived unless serve.resources.limits.memory is set (then checked to hold it): the
          # query API's caches + {{ .Values.serve.resources.memory.overheadMiB }} Mi = {{ include "lance-sink.serve.memoryNeedMiB" . }}Mi.
          memory: {{ include "lance-sink.serve.memoryLimit" . | quote }}
      {{- else }}
      resources:
        requests:
          {{- with .Values.resources.requests.cpu }}
          cpu: {{ . | quote }}
          {{- end }}
          memory: {{ default (include "lance-sink.memoryLimit" .) .Values.resources.requests.memory | quote }}
        limits:
          {{- with .Values.resources.limits.cpu }}
          cpu: {{ . | quote }}
          {{- end }}
          # Derived from config.backpressure.process_budget_bytes unless resources.limits.memory
          # is set (then checked to hold it): ceil(budget x {{ .Values.resources.memory.budgetFactor }} / 1 MiB) + {{ .Values.resources.memory.overheadMiB }} Mi
          # + the query API's unindexed cache + the maintenance process = {{ include "lance-sink.memoryNeedMiB" . }}Mi.
          memory: {{ include "lance-sink.memoryLimit" . | quote }}
      {{- end }}
      volumeMounts:
        - name: config
          mountPath: {{ include "lance-sink.configDir" . }}
          readOnly: true
        - name: tmp
          mountPath: /tmp
        {{- if $s.kafkaTls.existingSecret }}
        - name: kafka-tls
          mountPath: {{ $s.kafkaTls.mountPath }}
          readOnly: true
        {{- end }}
        {{- if and (not $serve) (eq .Values.storage.mode "localVolume") }}
        - name: data
          mountPath: {{ .Values.storage.localVolume.mountPath }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "lance-sink.fullname" . }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ .Values.tmpVolume.sizeLimit | toJson }}
    {{- if $s.kafkaTls.existingSecret }}
    - name: kafka-tls
      secret:
        secretName: {{ $s.kafkaTls.existingSecret }}
        defaultMode: 0440
        items:
          {{- range $key := list $s.kafkaTls.caKey $s.kafkaTls.certificateKey $s.kafkaTls.keyKey }}
          {{- if $key }}
          - key: {{ $key }}
            path: {{ $key }}
          {{- end }}
          {{- end }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  # Spread over zones and nodes; a constraint without labelSelector counts this release's pods.
  topologySpreadConstraints:
    {{- $constraints := list }}
    {{- range . }}
    {{- $constraint := deepCopy . }}
    {{- if not (hasKey $constraint "labelSelector") }}
    {{- $_ := set $constraint "labelSelector" (dict "matchLabels" ($selectorLabels | fromYaml)) }}
    {{- end }}
    {{- $constraints = append $constraints $constraint }}
    {{- end }}
    {{- toYaml $constraints | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}


{{/* The writer container's environment: the advertised query URL (the pod IP from the
downward API, unless config.query.advertised_url is set), then lance-sink.sharedEnv. Empty =
no env. */}}
{{- define "lance-sink.env" -}}
{{- $q := .Values.config.query -}}
{{- if and $q.enabled (not $q.advertised_url) }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: LANCE_SINK__QUERY__ADVERTISED_URL
  value: "http://$(POD_IP):{{ $q.port }}"
{{- end }}
{{- include "lance-sink.sharedEnv" . }}
{{- end -}}

{{/*
The serve pods' environment: their own unindexed cache bound (serve.unindexedCacheBytes,
unless null), then lance-sink.sharedEnv. Empty = no env.
*/}}
{{- define "lance-sink.serve.env" -}}
{{- if not (kindIs "invalid" .Values.serve.unindexedCacheBytes) }}
- name: LANCE_SINK__QUERY__UNINDEXED_CACHE_BYTES
  value: {{ .Values.serve.unindexedCacheBytes | toString | quote }}
{{- end }}
{{- include "lance-sink.sharedEnv" . }}
{{- end -}}

{{/* The environment of both tiers: secrets by reference, then extraEnv. Empty = no env. */}}
{{- define "lance-sink.sharedEnv" -}}
{{- $s := .Values.secrets -}}
{{- if $s.objectStore.existingSecret }}
- name: LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $s.objectStore.existingSecret }}
      key: {{ $s.objectStore.accessKeyIdKey }}
- name: LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $s.objectStore.existingSecret }}
      key: {{ $s.objectStore.secretAccessKeyKey }}
{{- if $s.objectStore.sessionTokenKey }}
- name: LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SESSION_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $s.objectStore.existingSecret }}
      key: {{ $s.objectStore.sessionTokenKey }}
{{- end }}
{{- end }}
{{- if $s.kafkaSasl.existingSecret }}
- name: LANCE_SINK__KAFKA__SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $s.kafkaSasl.existingSecret }}
      key: {{ $s.kafkaSasl.passwordKey }}
{{- end }}
{{- if and $s.kafkaTls.existingSecret $s.kafkaTls.keyPasswordKey }}
- name: LANCE_SINK__KAFKA__SSL_KEY_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $s.kafkaTls.existingSecret }}
      key: {{ $s.kafkaTls.keyPasswordKey }}
{{- end }}
{{- if $s.schemaRegistry.existingSecret }}
{{- range $env, $key := dict "BASIC_AUTH_PASSWORD" $s.schemaRegistry.basicAuthPasswordKey "BEARER_TOKEN" $s.schemaRegistry.bearerTokenKey "SSL_KEY_PASSWORD" $s.schemaRegistry.keyPasswordKey }}
{{- if $key }}
- name: LANCE_SINK__SOURCE__SCHEMA_REGISTRY__{{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ $s.schemaRegistry.existingSecret }}
      key: {{ $key }}
{{- end }}
{{- end }}
{{- end }}
{{- if $s.queryAuth.existingSecret }}
- name: LANCE_SINK__QUERY__AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $s.queryAuth.existingSecret }}
      key: {{ $s.queryAuth.tokenKey }}
{{- end }}
{{- with .Values.extraEnv }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end -}}
