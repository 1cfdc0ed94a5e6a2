{{/* Labels every object carries. */}}
{{- define "kinfer.labels" -}}
app.kubernetes.io/part-of: kinfer
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kinfer.image" -}}
image: {{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy | default "IfNotPresent" }}
{{- end -}}

{{/* Where Kafka and Redis are, logs and traces: every container's environment.
     Call with (dict "root" $ "principal" "kinfer-worker"); in secure mode each component is its own
     principal of ops/deploy/secure.py's table, with a Secret <principal>-credentials (keys
     kafka-password and redis-url: the Redis URL with that principal's ACL user). */}}
{{- define "kinfer.env" -}}
{{- $v := .root.Values -}}
envFrom:
  - configMapRef: {name: {{ .root.Release.Name }}-endpoints}
{{- if $v.secure.enabled }}
env:
  - {name: KINFER_KAFKA_USER, value: {{ .principal | quote }}}
  - name: KINFER_KAFKA_PASSWORD
    valueFrom: {secretKeyRef: {name: {{ printf "%s-credentials" .principal }}, key: kafka-password}}
  - name: KINFER_REDIS_URL
    valueFrom: {secretKeyRef: {name: {{ printf "%s-credentials" .principal }}, key: redis-url}}
  {{- if has .principal (list "kinfer-worker" "kinfer-gateway") }}
  - name: KINFER_SIGNING_SECRET
    valueFrom: {secretKeyRef: {name: {{ $v.secure.signingSecret }}, key: secret}}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The brokers' CA, in secure mode: a flow list (empty otherwise), and the items alone for a list that has others. */}}
{{- define "kinfer.caMount" -}}
{name: kafka-ca, mountPath: /etc/kinfer/ca, readOnly: true}
{{- end -}}
{{- define "kinfer.caVolume" -}}
{name: kafka-ca, secret: {secretName: {{ .Values.secure.caSecret }}, items: [{key: ca.pem, path: ca.pem}]}}
{{- end -}}
{{- define "kinfer.secureMounts" -}}
[{{ if .Values.secure.enabled }}{{ include "kinfer.caMount" . }}{{ end }}]
{{- end -}}
{{- define "kinfer.secureVolumes" -}}
[{{ if .Values.secure.enabled }}{{ include "kinfer.caVolume" . }}{{ end }}]
{{- end -}}
